"""Adapter slots on the model's projections, applied by forward hooks.

Every projection the adapters may target gets a `LoRALayer`: device buffers A [slots, R, in] and
B [slots, out, R] and a forward hook adding the batched adapter matmuls of the current step to the
projection's output. R is `max_lora_rank` per packed shard: a packed projection (q/k/v in one
matmul, gate/up, a mixer's fused in_proj) puts each checkpoint module's rank in its own column
block of B, and its rows where the projection's own weight loader puts that module's rows, so
this rank's share of every adapter matrix is cut exactly like its share of the base weight.

    B of qkv_proj for one slot:   columns [ q's r | k's r | v's r ]
                                  rows    q rows: B_q, k rows: B_k, v rows: B_v, zeros elsewhere
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from kernels.lora_reference import LoRASegments
from kernels.lora_registry import LoRAKernels
from worker.distributed import all_reduce
from worker.layers.linear import (
    ColumnParallelLinear,
    ProjectionWeights,
    ReplicatedLinear,
    RowParallelLinear,
)
from worker.layers.loading import ShardId, weight_loader_of
from worker.lora.peft_files import LoRAWeights

LORA_TARGET_TYPES = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, ProjectionWeights)
"""Module types an adapter may target (every projection of every family)."""


class LoRAStep:
    """The segments of the step being run (built once per step) and the kernels, shared by
    every `LoRALayer` of one model.

    Segments are set only inside `active`, which resets them in `finally`, so no forward sees
    a stale step.
    """

    def __init__(self, kernels: LoRAKernels) -> None:
        self.kernels = kernels
        self.segments: LoRASegments | None = None

    @contextmanager
    def active(self, segments: LoRASegments | None) -> Iterator[None]:
        self.segments = segments
        try:
            yield
        finally:
            self.segments = None

    def token_slots(self) -> torch.Tensor | None:
        """[T] every batch row's device slot (-1: no adapter); None when no row has one."""
        return None if self.segments is None else self.segments.row_slots


class LoRALayer:
    """One projection's adapter slots and the hook that applies them."""

    def __init__(self, module: nn.Module, num_slots: int, max_rank: int, step: LoRAStep) -> None:
        weight = module.weight
        assert isinstance(weight, nn.Parameter), f"{type(module).__name__} has no weight"
        shards = getattr(module, "shards", None)
        self.shard_ids: list[ShardId] = list(shards) if isinstance(shards, dict) else [None]
        self.max_rank = max_rank
        self.is_row_parallel = isinstance(module, RowParallelLinear)
        self.tp_size = module.parallel.tp_size if isinstance(module, RowParallelLinear) else 1
        self.load = weight_loader_of(weight)
        total_rank = max_rank * len(self.shard_ids)
        out_features, in_features = weight.shape
        self.lora_a = torch.zeros(
            (num_slots, total_rank, in_features), dtype=weight.dtype, device=weight.device
        )
        self.lora_b = torch.zeros(
            (num_slots, out_features, total_rank), dtype=weight.dtype, device=weight.device
        )
        self.step = step
        module.register_forward_hook(self.hook)

    def set_slot(self, slot: int, weights: dict[ShardId, LoRAWeights]) -> None:
        """Put an adapter's matrices for this projection (by shard) in `slot`; others zero."""
        self.clear_slot(slot)
        for shard_id, lora in weights.items():
            block = self.shard_ids.index(shard_id) if shard_id in self.shard_ids else 0
            start = block * self.max_rank
            rank = lora.a.shape[0]
            cols = slice(start, start + rank)
            if self.is_row_parallel:  # A is split by input columns, B is whole
                self.lora_a[slot, cols] = self._loaded((rank, self.lora_a.shape[2]), lora.a, None)
                self.lora_b[slot, :, cols] = lora.b.to(self.lora_b)
            else:  # A is whole, B's rows are cut like the weight's rows of this shard
                self.lora_a[slot, cols] = lora.a.to(self.lora_a)
                b_rows = self._loaded((self.lora_b.shape[1], rank), lora.b, shard_id)
                self.lora_b[slot, :, cols] = b_rows

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def _loaded(
        self, shape: tuple[int, int], source: torch.Tensor, shard_id: ShardId
    ) -> torch.Tensor:
        """This rank's part of `source`, cut by the base weight's own loader."""
        target = nn.Parameter(
            torch.zeros(shape, dtype=self.lora_a.dtype, device=self.lora_a.device),
            requires_grad=False,
        )
        self.load(target, source, shard_id)
        return target.data

    def hook(self, module: nn.Module, inputs: tuple[Any, ...], output: torch.Tensor) -> Any:
        """Forward hook: output + this step's adapter deltas (None: output unchanged)."""
        segments = self.step.segments
        if segments is None or segments.num_rows == 0:
            return None
        kernels = self.step.kernels
        shrunk = kernels.shrink(inputs[0], self.lora_a, segments)  # rows x R
        if self.tp_size > 1:  # each rank saw only its input columns
            shrunk = all_reduce(shrunk)
        return kernels.expand(output, shrunk, self.lora_b, segments)

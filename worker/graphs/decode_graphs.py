"""CUDA graphs of uniform decode steps: capture per padded size, replay, rebuild.

A step whose requests all have the same number `q` of query rows (decode: 1; verify of k
drafts: k + 1), no images, no prompt logprobs and recurrent states in one wave runs from the
persistent buffers of `StaticBatch`, padded to the smallest captured size. On CUDA each
(q, size) is one full graph over the whole model forward (attention of every kind, recurrent
state layers, MoE, LoRA), captured after the KV cache is bound; sampling and logits stay outside
it. Every other step runs eagerly. Without capture (CPU) the same static-buffer step runs the
forward directly: tests compare it with the eager path, and compile it with
`torch.compile(fullgraph=True)`, which fails on any host synchronisation or graph break.

Graphs hold the addresses of the weights, KV caches and buffers: after anything moves them
(a weight reload into new tensors) `rebuild` drops and recaptures every graph.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from worker.attention.attention import ForwardContext
from worker.attention.attention_groups import AttentionGroup
from worker.graphs.capture_sizes import (
    CudaGraphConfig,
    capture_request_counts,
    padded_request_count,
)
from worker.graphs.static_batch import StaticBatch, StaticShape
from worker.input_batch import InputBatch
from worker.state.mamba_metadata import MambaWave

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from worker.lora.manager import LoRAManager
    from worker.runner_config import RunnerConfig

logger = logging.getLogger(__name__)


class GraphSource(Protocol):
    """What the captured steps read from a model runner with a bound KV cache (the runner
    satisfies it; named here so that this module does not import the runner)."""

    device: torch.device
    config: RunnerConfig
    model: Any
    attention_groups: list[AttentionGroup]
    kv_caches: dict[str, tuple[torch.Tensor, ...]]
    drafter_layers: Any
    drafter_state_layers: Any
    _mamba_groups: dict[str, int]
    lora: LoRAManager | None

    def _require_states(self) -> Any: ...


ACTIVATION_ROWS_FACTOR = 8
"""Live activations of one row in a decode forward, in units of the widest projection output
(the memory estimate of the graph pool before the KV cache is sized)."""

ModelFn = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


@dataclass(frozen=True)
class GraphParts:
    """What the captured step reads from the runner (after the KV cache is bound)."""

    model: nn.Module
    groups: list[AttentionGroup]
    kv_caches: dict[str, tuple[torch.Tensor, ...]]
    state_layers: dict[str, int]
    """Recurrent-state layer -> its KV cache group."""
    table_widths: tuple[int, ...]
    max_num_seqs: int
    num_spec_tokens: int
    lora: LoRAManager | None
    device: torch.device


def decode_graphs_for(runner: GraphSource, config: CudaGraphConfig) -> DecodeGraphs | None:
    """The runner's captured decode steps (None: graphs off, or not on this device; logged)."""
    if not config.is_enabled:
        logger.info("CUDA graphs off (enforce_eager or cudagraph_mode %s)", config.mode.value)
        return None
    if runner.device.type != "cuda":
        logger.info("CUDA graphs off: the device is %s (decode steps run eagerly)", runner.device)
        return None
    return DecodeGraphs(graph_parts(runner), config, capture=True)


def graph_parts(runner: GraphSource) -> GraphParts:
    """What a runner with a bound KV cache gives its captured steps."""
    states = runner._require_states()
    spec = runner.config.speculative
    drafter = {layer.layer_name for layer in (*runner.drafter_layers, *runner.drafter_state_layers)}
    return GraphParts(
        model=runner.model,
        groups=[g for g in runner.attention_groups if g.layer_names[0] not in drafter],
        kv_caches=runner.kv_caches,
        state_layers={
            name: gid for name, gid in runner._mamba_groups.items() if name not in drafter
        },
        table_widths=tuple(table.table_np.shape[1] for table in states.block_tables.tables),
        max_num_seqs=runner.config.max_num_seqs,
        num_spec_tokens=spec.num_speculative_tokens if spec is not None else 0,
        lora=runner.lora,
        device=runner.device,
    )


def graph_memory_estimate(model: nn.Module, config: RunnerConfig, device: torch.device) -> int:
    """Bytes the graph pool of a runner is expected to take, before its KV cache is sized: the
    activations of the largest captured step (0 when nothing is captured)."""
    if device.type != "cuda":
        return 0
    spec = config.speculative.num_speculative_tokens if config.speculative else 0
    return _activation_bytes(model, config.cuda_graphs, config.max_num_seqs, spec)


def _activation_bytes(
    model: nn.Module, config: CudaGraphConfig, max_num_seqs: int, num_spec_tokens: int
) -> int:
    rows = max(
        (
            counts[-1] * q
            for q in {1, 1 + num_spec_tokens}
            if (counts := capture_request_counts(config, max_num_seqs, q))
        ),
        default=0,
    )
    return rows * widest_projection(model) * ACTIVATION_ROWS_FACTOR


@dataclass(frozen=True)
class StepPlan:
    """A step that runs from the static buffers: q rows per request, padded request count."""

    rows_per_req: int
    padded: int


class DecodeGraphs:
    """Static-buffer decode steps of one runner, captured as CUDA graphs when `capture`."""

    def __init__(
        self,
        parts: GraphParts,
        config: CudaGraphConfig,
        capture: bool,
        compile_backend: str | None = None,
    ) -> None:
        """`compile_backend`: run the static step through `torch.compile(fullgraph=True)` with
        this backend instead of capturing (tests)."""
        self.parts, self.config, self.capture = parts, config, capture
        self.counts: dict[int, list[int]] = {}
        """q -> captured request counts, ascending."""
        self.batches: dict[int, StaticBatch] = {}
        for rows in sorted({1, 1 + parts.num_spec_tokens}):
            counts = capture_request_counts(config, parts.max_num_seqs, rows)
            if counts:
                self.counts[rows] = counts
                self.batches[rows] = StaticBatch(
                    self._shape(rows, counts[-1]), parts.groups, parts.device
                )
        self._model_fn: ModelFn = parts.model
        if compile_backend is not None:
            self._model_fn = torch.compile(
                parts.model, fullgraph=True, backend=compile_backend, dynamic=False
            )
        self._contexts: dict[tuple[int, int], ForwardContext] = {}
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.static_steps: dict[int, int] = dict.fromkeys(self.counts, 0)
        """Steps run from the static buffers so far (replayed or not), by rows per request."""

    def _shape(self, rows: int, max_reqs: int) -> StaticShape:
        return StaticShape(
            max_reqs=max_reqs,
            rows_per_req=rows,
            table_widths=self.parts.table_widths,
            state_groups=tuple(sorted(set(self.parts.state_layers.values()))),
            cut_offsets=tuple(range(1, rows)),
            lora_slots=self.parts.lora.config.max_loras if self.parts.lora else 0,
        )

    def plan(self, batch: InputBatch, ctx: ForwardContext, has_extras: bool) -> StepPlan | None:
        """How `batch` runs from the static buffers, or None when it runs eagerly (`has_extras`:
        image inputs or prompt-logprob rows)."""
        query_lens = np.diff(batch.query_start_loc_np)
        if has_extras or batch.key_ends is not None or not len(query_lens):
            return None
        rows = int(query_lens[0])
        if rows not in self.counts or (query_lens != rows).any():
            return None
        padded = padded_request_count(batch.num_reqs, self.counts[rows])
        if padded is None:
            return None
        offsets = self.batches[rows].shape.cut_offsets
        expected = [req * rows + off for req in range(batch.num_reqs) for off in offsets]
        waves = self._waves(ctx)
        if waves is None or any(list(w.cut_positions) != expected for w in waves.values()):
            return None  # states in waves, or a verify step not keeping every draft's state
        return StepPlan(rows, padded)

    def _waves(self, ctx: ForwardContext) -> dict[int, MambaWave] | None:
        """Per recurrent group, its single whole-step wave (None: some group has several)."""
        waves: dict[int, MambaWave] = {}
        for name, gid in self.parts.state_layers.items():
            meta = ctx.mamba_metadata[name]
            if len(meta.waves) != 1 or meta.waves[0].token_index is not None:
                return None
            waves[gid] = meta.waves[0]
        return waves

    def run(self, plan: StepPlan, batch: InputBatch, ctx: ForwardContext) -> torch.Tensor:
        """The step's hidden states `[num_tokens, hidden]` from the static buffers."""
        static = self.batches[plan.rows_per_req]
        lora = self.parts.lora
        slots = lora.step.token_slots() if lora is not None else None
        static.fill(batch, plan.padded, self._waves(ctx) or {}, slots)
        self.static_steps[plan.rows_per_req] += 1
        key = (plan.rows_per_req, plan.padded)
        captured = self._graphs.get(key)
        if captured is not None:
            captured[0].replay()
            hidden = captured[1]
        else:
            hidden = self._forward(key)
        return hidden[: batch.num_tokens]

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        rows, padded = key
        static = self.batches[rows]
        if key not in self._contexts:
            parts = self.parts
            self._contexts[key] = static.context(
                padded, parts.groups, parts.kv_caches, parts.state_layers
            )
        lora = self.parts.lora
        applied = (
            contextlib.nullcontext() if lora is None else lora.active(static.lora_segments(padded))
        )
        num_rows = padded * rows
        with applied:
            return self._model_fn(
                static.input_ids[:num_rows], static.positions[:num_rows], self._contexts[key]
            )

    def capture_all(self) -> None:
        """Capture every (q, size) graph, largest first, into one memory pool (CUDA only)."""
        if not self.capture:
            return
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(self.parts.device)[0]
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.parts.device)  # type: ignore[no-untyped-call]
        for rows, counts in self.counts.items():
            for padded in reversed(counts):
                self._capture_one((rows, padded), pool, stream)
        torch.cuda.synchronize(self.parts.device)
        used = free_before - torch.cuda.mem_get_info(self.parts.device)[0]
        logger.info(
            "CUDA graphs: %d captured in %.1f s (%.0f MiB; estimated %.0f MiB); sizes %s",
            len(self._graphs), time.perf_counter() - start, used / 2**20,
            self.memory_estimate() / 2**20, self.counts,
        )  # fmt: skip

    def _capture_one(
        self, key: tuple[int, int], pool: _POOL_HANDLE, stream: torch.cuda.Stream
    ) -> None:
        """Warm up on a side stream (lazy allocations, kernel autotuning), then capture."""
        stream.wait_stream(torch.cuda.current_stream(self.parts.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(key)
        torch.cuda.current_stream(self.parts.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = self._forward(key)
        self._graphs[key] = (graph, hidden)

    def drop(self) -> None:
        """Forget every graph and context (their addresses are stale)."""
        self._graphs.clear()
        self._contexts.clear()
        if self.capture:
            torch.cuda.empty_cache()

    def rebuild(self) -> None:
        """Drop and recapture every graph (after weights or caches moved)."""
        self.drop()
        self.capture_all()

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def memory_estimate(self) -> int:
        """Bytes the graph pool is expected to take (0 without capture)."""
        if not self.capture:
            return 0
        parts = self.parts
        return _activation_bytes(
            parts.model, self.config, parts.max_num_seqs, parts.num_spec_tokens
        )


def widest_projection(model: nn.Module) -> int:
    """Bytes of one row of the model's widest projection output (embeddings and LM head aside:
    logits are computed outside the graph)."""
    widths = [
        max(param.shape[-2:]) * param.element_size()
        for name, param in model.named_parameters()
        if param.dim() >= 2 and "embed" not in name and "lm_head" not in name
    ]
    return max(widths, default=0)

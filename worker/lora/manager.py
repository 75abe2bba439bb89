"""The worker's adapters: host copies (LRU of `max_cpu_loras`) and device slots (LRU of
`max_loras`), and each step's per-token adapter segments.

Projections get `LoRALayer`s; stacked MoE expert weights (PEFT's `target_parameters`) get
`ExpertLoRALayer`s, registered on their experts module's `expert_deltas`. `add_adapter` reads and
checks a PEFT folder once (it may run before the step that needs it);
`segments_for` puts the step's adapters in device slots, evicting only adapters the step does not
use, and groups the step's tokens by slot for the batched matmuls.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from kernels.lora_reference import LoRASegments
from scheduler.lora import LoRAConfig, LoRARequest
from worker.layers.expert_deltas import expert_deltas_of, stacked_weight_of
from worker.layers.loading import ShardId
from worker.lora.experts import ExpertLoRALayer, expert_parameter
from worker.lora.layers import LORA_TARGET_TYPES, LoRALayer, LoRAStep
from worker.lora.peft_files import LoRAWeights, PeftAdapter, read_peft_adapter
from worker.weights import packed_target

logger = logging.getLogger(__name__)

ModuleWeights = dict[str, dict[ShardId, LoRAWeights]]
"""Our module name -> shard -> the adapter's weights for it."""


class LoRAManager:
    """Adapters of one worker rank's model."""

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.modules = dict(model.named_modules())
        self.renames: tuple[tuple[str, str], ...] = getattr(model, "renames", ())
        self.step = LoRAStep()
        self.layers: dict[str, LoRALayer | ExpertLoRALayer] = {}
        self.host: OrderedDict[str, ModuleWeights] = OrderedDict()
        self.slots: OrderedDict[str, int] = OrderedDict()
        """Adapter name -> device slot, least recently used first."""
        self.load_seconds: dict[str, float] = {}

    def add_adapter(self, lora: LoRARequest) -> None:
        """Read and check `lora` into the host cache (a no-op when it is there)."""
        if lora.lora_name in self.host:
            self.host.move_to_end(lora.lora_name)
            return
        start = time.perf_counter()
        adapter = read_peft_adapter(lora.lora_name, lora.lora_path, self.dtype)
        if adapter.rank > self.config.max_lora_rank:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} has rank {adapter.rank}, above "
                f"max_lora_rank={self.config.max_lora_rank}"
            )
        weights: ModuleWeights = {}
        for hf_module, lora_weights in adapter.modules.items():
            target, shard_id = self._resolve(adapter, hf_module, lora_weights)
            weights.setdefault(target, {})[shard_id] = lora_weights
        self.host[lora.lora_name] = weights
        while len(self.host) > self.config.num_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.info("LoRA adapter %r left the host cache", evicted)
        self.load_seconds[lora.lora_name] = time.perf_counter() - start
        logger.info(
            "LoRA adapter %r read in %.3f s", lora.lora_name, self.load_seconds[lora.lora_name]
        )

    def remove_adapter(self, lora_name: str) -> None:
        """Forget an adapter (host copy and device slot); its name may be loaded again."""
        self.host.pop(lora_name, None)
        slot = self.slots.pop(lora_name, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)

    def _resolve(
        self, adapter: PeftAdapter, hf_module: str, lora: LoRAWeights
    ) -> tuple[str, ShardId]:
        """Our projection (or stacked expert weight) and shard for the adapter's module name;
        ValueError if none."""
        name = hf_module.replace(".base_layer", "") + ".weight"
        for old, new in self.renames:
            name = name.replace(old, new)
        experts = self.modules.get(name.removesuffix(".weight"))
        deltas = expert_deltas_of(experts)
        if adapter.target_parameters and deltas is not None and experts is not None:
            spec = expert_parameter(adapter, hf_module, experts, deltas, lora)
            return f"{name.removesuffix('.weight')}.{spec.name}", None
        packed = packed_target(name)
        param_name, shard_id = packed if packed is not None else (name, None)
        module_name = param_name.removesuffix(".weight")
        module = self.modules.get(module_name)
        if not isinstance(module, LORA_TARGET_TYPES) or ".base_layer" in hf_module:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} targets module {hf_module!r}, which this model "
                "does not have (or cannot adapt)"
            )
        if lora.a.shape[0] != adapter.rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r}: {hf_module} has lora_A {tuple(lora.a.shape)}, "
                f"not of rank r={adapter.rank}"
            )
        return module_name, shard_id

    def segments_for(
        self, loras: Sequence[LoRARequest | None], num_tokens: Sequence[int]
    ) -> LoRASegments | None:
        """Rows of each adapter in a batch of requests (`num_tokens` rows each, in order)."""
        step_names = {lora.lora_name for lora in loras if lora is not None}
        if not step_names:
            return None
        req_slots = [-1 if lora is None else self._slot_of(lora, step_names) for lora in loras]
        row_slots = np.repeat(np.array(req_slots, dtype=np.int64), num_tokens)
        rows = np.flatnonzero(row_slots >= 0)
        if rows.size == 0:
            return None
        adapted = row_slots[rows]
        slot_ids, lengths = np.unique(adapted, return_counts=True)
        token_idx = rows[np.argsort(adapted, kind="stable")]  # grouped by slot, in slot order
        return LoRASegments(
            token_idx=torch.from_numpy(token_idx).to(self.device),
            slot_ids=tuple(slot_ids.tolist()),
            lengths=tuple(lengths.tolist()),
            row_slots=torch.from_numpy(row_slots).to(self.device),
        )

    @contextmanager
    def active(self, segments: LoRASegments | None) -> Iterator[None]:
        """Apply `segments` to every forward inside the block."""
        with self.step.active(segments):
            yield

    def _slot_of(self, lora: LoRARequest, step_names: set[str]) -> int:
        """`lora`'s device slot, loading it there (evicting an adapter this step does not use)."""
        name = lora.lora_name
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        self.add_adapter(lora)
        slot = self._free_slot(step_names)
        for module_name, weights in self.host[name].items():
            self._layer(module_name).set_slot(slot, weights)
        self.slots[name] = slot
        return slot

    def _free_slot(self, step_names: set[str]) -> int:
        used = set(self.slots.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in used]
        if free:
            return free[0]
        for name, slot in self.slots.items():
            if name not in step_names:
                del self.slots[name]
                for layer in self.layers.values():
                    layer.clear_slot(slot)
                return slot
        raise RuntimeError(
            f"a step uses {len(step_names)} adapters, more than max_loras={self.config.max_loras}"
        )

    def _layer(self, target: str) -> LoRALayer | ExpertLoRALayer:
        """The projection's (or stacked expert weight's) adapter slots, created the first time
        an adapter targets it."""
        layer = self.layers.get(target)
        if layer is not None:
            return layer
        slots, rank = self.config.max_loras, self.config.max_lora_rank
        if target in self.modules:
            layer = LoRALayer(self.modules[target], slots, rank, self.step)
        else:  # '<experts module>.<our stacked weight>'
            module_name, _, param_name = target.rpartition(".")
            deltas = expert_deltas_of(self.modules[module_name])
            assert deltas is not None, f"{module_name} keeps no stacked experts"
            spec = next(s for s in deltas.peft_parameters.values() if s.name == param_name)
            weight = stacked_weight_of(self.modules[module_name], param_name)
            layer = ExpertLoRALayer(weight, spec, slots, rank, self.step)
            deltas.deltas[param_name] = layer
        self.layers[target] = layer
        return layer

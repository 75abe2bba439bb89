"""The worker's adapters: host copies (LRU of `max_cpu_loras`) and device slots (LRU of
`max_loras`), and each step's per-token adapter segments.

Projections get `LoRALayer`s; stacked MoE expert weights (PEFT's `target_parameters`) get
`ExpertLoRALayer`s, registered on their experts module's `expert_deltas`. `add_adapter` reads and
checks a PEFT folder once, between steps (the engine calls it when a request names a new
adapter), and starts copying it into a device slot in the background, so the step that needs it
finds it there; `prefetch` does the same at each step for the adapters of the next waiting
requests (an adapter evicted from its slot and named again). `segments_for` waits for the step's
copies (loading in the step only an adapter that had no slot to go to), and groups the step's
rows by slot once for every projection. A slot is taken from an adapter only when no request the
worker holds uses it and no copy into it is pending (a step that needs a slot may wait for such a
copy and take its slot: the request it was copied for did not come).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from kernels.lora_reference import LoRASegments, lora_segments
from kernels.lora_registry import select_lora_kernels
from scheduler.lora import LoRAConfig, LoRARequest
from worker.layers.expert_deltas import expert_deltas_of, stacked_weight_of
from worker.layers.loading import ShardId
from worker.lora.experts import ExpertLoRALayer, expert_parameter
from worker.lora.layers import LORA_TARGET_TYPES, LoRALayer, LoRAStep
from worker.lora.peft_files import LoRAWeights, PeftAdapter, read_peft_adapter
from worker.lora.slot_loads import SlotLoads
from worker.weights import packed_target

logger = logging.getLogger(__name__)

ModuleWeights = dict[str, dict[ShardId, LoRAWeights]]
"""Our module name -> shard -> the adapter's weights for it."""


class LoRAManager:
    """Adapters of one worker rank's model."""

    def __init__(
        self, model: nn.Module, config: LoRAConfig, device: torch.device, kernels: str = "auto"
    ) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.modules = dict(model.named_modules())
        self.renames: tuple[tuple[str, str], ...] = getattr(model, "renames", ())
        self.step = LoRAStep(select_lora_kernels(kernels, device))
        self.loads = SlotLoads(device)
        self.held: set[str] = set()
        """Adapters of the requests the worker holds (their slots are never taken)."""
        self.num_step_loads = 0
        """Adapters copied into a slot inside a step (no slot was free when they were added)."""
        self.num_copies_ahead = 0
        """Adapters copied into a slot in the background, before a step needed them."""
        self._lock = threading.Lock()
        """Slot bookkeeping: the engine may add an adapter while a step runs on another thread."""
        self.layers: dict[str, LoRALayer | ExpertLoRALayer] = {}
        self.host: OrderedDict[str, ModuleWeights] = OrderedDict()
        self.slots: OrderedDict[str, int] = OrderedDict()
        """Adapter name -> device slot, least recently used first."""
        self.load_seconds: dict[str, float] = {}

    def add_adapter(self, lora: LoRARequest) -> None:
        """Read and check `lora` into the host cache (when not there) and start copying it into
        a device slot in the background (when one is free or held by an unused adapter, and
        every projection it targets has its slots: they are created in a step, not beside one)."""
        with self._lock:
            self._read_adapter(lora)
            self._copy_ahead(lora.lora_name, self.held)

    def prefetch(self, loras: Iterable[LoRARequest]) -> None:
        """Start copying the adapters the next waiting requests name into device slots in the
        background (as `add_adapter` does), taking no slot of an adapter a held request or
        another of `loras` uses; an adapter without a host copy is left to the step that needs
        it (reading belongs between steps)."""
        if not self.config.prefetch:
            return
        with self._lock:
            names = [lora.lora_name for lora in loras if lora.lora_name in self.host]
            keep = self.held.union(names)
            for name in names:
                self._copy_ahead(name, keep)

    def _copy_ahead(self, name: str, keep: set[str]) -> None:
        """Start copying host adapter `name` into a free slot or one no adapter of `keep` uses,
        unless it has a slot or targets a projection without slots yet (they are created in a
        step's own copies)."""
        if name in self.slots or not self.layers.keys() >= self.host[name].keys():
            return
        slot = self._free_slot(keep)
        if slot is not None:
            self._start_copy(name, slot)
            self.num_copies_ahead += 1

    def _read_adapter(self, lora: LoRARequest) -> None:
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
        with self._lock:
            self.host.pop(lora_name, None)
            self.loads.wait(lora_name)
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
        self,
        loras: Sequence[LoRARequest | None],
        num_tokens: Sequence[int],
        held: Iterable[LoRARequest | None] = (),
    ) -> LoRASegments | None:
        """Rows of each adapter in a batch of requests (`num_tokens` rows each, in order);
        `held`: the adapters of every request the worker holds (scheduled or not)."""
        with self._lock:
            self.held = {lora.lora_name for lora in (*held, *loras) if lora is not None}
            if not any(lora is not None for lora in loras):
                return None
            req_slots = [-1 if lora is None else self._slot_of(lora) for lora in loras]
        row_slots = torch.repeat_interleave(
            torch.tensor(req_slots, dtype=torch.int64), torch.tensor(num_tokens)
        )
        return lora_segments(row_slots, self.device)

    @contextmanager
    def active(self, segments: LoRASegments | None) -> Iterator[None]:
        """Apply `segments` to every forward inside the block."""
        with self.step.active(segments):
            yield

    def _slot_of(self, lora: LoRARequest) -> int:
        """`lora`'s device slot once its copy is done (copied now if it has no slot yet)."""
        name = lora.lora_name
        if name not in self.slots:
            self._read_adapter(lora)
            slot = self._free_slot(self.held, take_pending=True)
            if slot is None:
                raise RuntimeError(
                    f"a step uses {len(self.held)} adapters, more than "
                    f"max_loras={self.config.max_loras}"
                )
            self._start_copy(name, slot)
            self.num_step_loads += 1
        self.loads.wait(name)
        self.slots.move_to_end(name)
        return self.slots[name]

    def _free_slot(self, keep: set[str], *, take_pending: bool = False) -> int | None:
        """An empty slot, else the least recently used adapter's that is not in `keep` and not
        being copied (with `take_pending`, a step's need: a copy ahead whose request has not come
        is waited for and its slot taken); its name leaves `slots`; None when there is none."""
        used = set(self.slots.values())
        free = [slot for slot in range(self.config.max_loras) if slot not in used]
        if free:
            return free[0]
        for name, slot in self.slots.items():
            if name in keep or (self.loads.is_pending(name) and not take_pending):
                continue
            self.loads.wait(name)
            del self.slots[name]
            return slot
        return None

    def _start_copy(self, name: str, slot: int) -> None:
        """Give `slot` to `name` now and copy its weights there in the background (the slot's
        other projections are cleared, so nothing of a previous adapter stays)."""
        weights = self.host[name]
        targets = [
            (self._layer(module), module_weights) for module, module_weights in weights.items()
        ]
        others = [layer for module, layer in self.layers.items() if module not in weights]

        def copy() -> None:
            for layer, module_weights in targets:
                layer.set_slot(slot, module_weights)
            for layer in others:
                layer.clear_slot(slot)

        self.slots[name] = slot
        self.loads.start(name, copy)

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

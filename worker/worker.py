"""One worker per tensor-parallel rank: device, process group, model, KV cache, steps.

A plain class (no Ray): `cluster/` drives it in-process, in a spawned process per rank, or as
an actor. Call order: construct -> `determine_kv_cache_specs` / `available_kv_cache_memory` ->
`initialize_kv_cache` -> `execute` each step -> `shutdown`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.lora import LoRARequest
from scheduler.output import ModelRunnerOutput, OffloadOps, SchedulerOutput, TierPage
from scheduler.spec_config import SpecMethod
from worker.batch_invariant import install_batch_invariant
from worker.config import ModelConfig, ParallelConfig
from worker.distributed import destroy_distributed, init_distributed
from worker.graphs.decode_graphs import graph_memory_estimate
from worker.kv_cache import KVCacheSpecReport, available_kv_cache_memory
from worker.kv_io.kv_direct import (
    SEND_TIMEOUT_S,
    ShardOffer,
    fetch_shard,
    offer_counts,
    offer_shard,
)
from worker.kv_io.kv_transfer import (
    CacheLayer,
    GroupLayouts,
    KVShard,
    export_shard,
    group_layouts,
    import_shard,
    reshard,
)
from worker.model_loader import load_model
from worker.model_runner import ModelRunner, ModelSettings
from worker.models.qwen3_next_mtp import load_mtp
from worker.rpc import RpcCall, run_rpc
from worker.runner_config import RunnerConfig
from worker.sleep import MemoryResidency, SleepReport, copy_weights
from worker.weight_calls import WeightUpdateCalls

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one rank needs to start (picklable, sent to spawned processes)."""

    model_config: ModelConfig
    parallel: ParallelConfig
    runner: RunnerConfig
    distributed_init_method: str = "tcp://127.0.0.1:29500"
    """Rendezvous address of the process group (used when tp_size > 1)."""
    node_address: str = "127.0.0.1"
    """This rank's node address: its direct KV transfers (`worker.kv_io.kv_direct`) listen there."""


class Worker(WeightUpdateCalls):
    """Runs the model of one tensor-parallel rank.

    Start-up is split so that an executor can drive every rank through each phase together:
    construct (nothing heavy) -> `init_device` (device and process group; every rank needs rank
    0's rendezvous address first) -> `load_model` -> KV specs and memory -> `initialize_kv_cache`.
    `start_worker` runs the first three phases for a single process.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.parallel.rank
        self.device = spec.runner.device_for_rank(self.rank)
        self._model_runner: ModelRunner | None = None
        self._kv_cache_config: KVCacheConfig | None = None
        self._drafter: nn.Module | None = None
        self._memory: MemoryResidency | None = None

    def init_device(self) -> None:
        """Select the device and join the tensor-parallel process group."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        spec = self.spec
        init_distributed(
            self.rank, spec.parallel.tp_size, spec.distributed_init_method, backend=backend
        )

    def load_model(self) -> None:
        """Build the model and read this rank's shard of the weights."""
        spec = self.spec
        torch.manual_seed(spec.runner.seed)
        runner = spec.runner
        model = load_model(
            spec.model_config,
            spec.parallel,
            self.device,
            runner.load_format,
            runner.quantized_weight_mode,
        )
        settings = ModelSettings(
            dtype=spec.model_config.dtype,
            max_model_len=spec.model_config.max_model_len,
            eos_token_ids=spec.model_config.eos_token_ids,
        )
        self._drafter = self._load_drafter(model)
        if runner.batch_invariant:
            for module in (model, self._drafter):
                if module is not None:
                    install_batch_invariant(module)
        self._model_runner = ModelRunner(
            model, settings, spec.runner, self.device, self.rank == 0, self._drafter
        )

    def _load_drafter(self, target: nn.Module) -> nn.Module | None:
        """The draft model or the checkpoint's MTP layer, when speculation uses one."""
        spec = self.spec
        method = spec.runner.speculative.method if spec.runner.speculative else None
        if method is SpecMethod.MTP:
            return load_mtp(target, spec.model_config, spec.runner.load_format, spec.parallel)
        draft = spec.runner.draft_model
        if draft is None:
            return None
        runner = spec.runner
        return load_model(
            draft, spec.parallel, self.device, runner.load_format, runner.quantized_weight_mode
        )

    @property
    def model_runner(self) -> ModelRunner:
        if self._model_runner is None:
            raise RuntimeError("the worker's model is not loaded: call load_model() first")
        return self._model_runner

    def determine_kv_cache_specs(self) -> KVCacheSpecReport:
        """Per-layer KV specs of this rank (layers reading another layer's KV own none)."""
        return self.model_runner.kv_cache_specs()

    def available_kv_cache_memory(self) -> int:
        """Bytes this rank can give the KV cache (measured on CUDA, configured on CPU)."""
        runner = self.spec.runner
        budget = available_kv_cache_memory(
            self.device, runner.gpu_memory_utilization, runner.kv_cache_memory_bytes
        )
        if runner.kv_cache_memory_bytes is None:  # measured: leave room for the decode graphs
            model = self.model_runner.model
            budget -= graph_memory_estimate(model, runner, self.device)  # type: ignore[arg-type]
        return budget

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate this rank's KV buffers per the engine's plan and bind them to the layers."""
        self.model_runner.initialize_kv_cache(kv_cache_config)
        self._kv_cache_config = kv_cache_config

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; rank 0 returns the output, the other ranks None."""
        output = self.model_runner.execute(scheduler_output)
        return output if self.rank == 0 else None

    def export_kv_shard(
        self,
        block_ids: tuple[tuple[int, ...], ...],
        tier_pages: tuple[tuple[TierPage, ...], ...] = (),
        offer_timeout_s: float | None = None,
    ) -> KVShard | ShardOffer:
        """This rank's pages of these blocks (one list per KV cache group), in host memory,
        with the offload-tier entries `tier_pages` in their places; with `offer_timeout_s`,
        held here for that long and offered to the receiver over a direct connection."""
        tensors, num_blocks = self.model_runner.block_tensors
        store = self.model_runner.offload
        if not any(tier_pages):
            shard = export_shard(tensors, num_blocks, self.rank, block_ids)
        elif store is None:
            raise ValueError("kv transfer: tier pages asked of an engine with no offload tier")
        else:
            tier = (tier_pages, store.read_page)
            shard = export_shard(tensors, num_blocks, self.rank, block_ids, tier)
        if offer_timeout_s is None:
            return shard
        return offer_shard(shard, self.spec.node_address, offer_timeout_s)

    def import_kv_shards(
        self,
        shards: tuple[KVShard | ShardOffer, ...],
        selected: tuple[tuple[int, ...], ...],
        block_ids: tuple[tuple[int, ...], ...],
        fetch_timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        """Write this rank's shard of a transfer onto these blocks: `shards[rank]` when the
        sender ran this tensor-parallel size (an offered one taken from the sending rank within
        `fetch_timeout_s`), else resharded from all of them (pages, not offers)."""
        tensors, num_blocks = self.model_runner.block_tensors
        tp_size = self.spec.parallel.tp_size
        if len(shards) == tp_size:
            shard = shards[self.rank]
            if isinstance(shard, ShardOffer):
                shard = fetch_shard(shard, fetch_timeout_s)
        else:
            pages = [shard for shard in shards if isinstance(shard, KVShard)]
            assert len(pages) == len(shards), "offers are taken before a reshard"
            shard = reshard(pages, self._group_layouts, tensors, tp_size, self.rank)
        import_shard(tensors, num_blocks, shard, selected, block_ids)

    def kv_offer_counts(self) -> tuple[int, int, int]:
        """This rank's direct offers: (made, ended, dropped) (`worker.kv_io.kv_direct`)."""
        return offer_counts()

    @functools.cached_property
    def _group_layouts(self) -> GroupLayouts:
        """How TP cuts each cache tensor of each group (once: the layers and caches are fixed)."""
        runner = self.model_runner
        assert self._kv_cache_config is not None, "initialize_kv_cache must be called first"
        layers: list[CacheLayer] = [*runner.layers, *runner.mamba_layers]
        return group_layouts(self._kv_cache_config, runner.kv_caches, layers)

    def run_offload_ops(self, ops: OffloadOps) -> None:
        """Run offload-tier copies outside a step (stores of blocks about to be overwritten)."""
        offload = self.model_runner.offload
        assert offload is not None, "initialize_kv_cache must be called first"
        offload.run(ops)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter into the host cache; ValueError naming it when it is
        missing, malformed, too large or targets modules the model lacks."""
        manager = self.model_runner.lora
        if manager is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        manager.add_adapter(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        """Forget an adapter on this rank (it may be added again under the same name)."""
        if self.model_runner.lora is not None:
            self.model_runner.lora.remove_adapter(lora_name)

    def sleep(self, level: int) -> SleepReport:
        """Release the KV pool and the weights (level 1 keeps a host copy; `worker.sleep`)."""
        return self.memory.sleep(level)

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Restore the memory of `tags` ("weights", "kv_cache"); after a level-2 sleep the
        checkpoint is read again once both are back, unless weights were loaded meanwhile."""
        self.memory.wake_up(tags, self._reload_from_checkpoint)

    def mark_weights_loaded(self) -> None:
        """New weights were written into this rank's awake weight memory (weight updates). A
        separate draft model, which updates do not reach, is read again from its own checkpoint
        when a level-2 sleep left it empty."""
        if self.memory.needs_weights and self._separate_draft_model():
            self._reload_draft_model()
        self.memory.mark_weights_loaded()

    def _separate_draft_model(self) -> bool:
        runner = self.spec.runner
        method = runner.speculative.method if runner.speculative else None
        return self._drafter is not None and method is not SpecMethod.MTP

    def _reload_draft_model(self) -> None:
        runner = self.spec.runner
        fresh = load_model(
            runner.draft_model,
            self.spec.parallel,
            self.device,
            runner.load_format,
            runner.quantized_weight_mode,
        )
        assert isinstance(self._drafter, nn.Module)
        copy_weights([self._drafter], [fresh])

    def run_rpc(self, call: RpcCall) -> object:
        """`collective_rpc` on this rank (`worker.rpc`)."""
        return run_rpc(self, call)

    @property
    def memory(self) -> MemoryResidency:
        if self._memory is None:
            runner = self.model_runner
            self._memory = MemoryResidency(
                self.device,
                lambda: [m for m in (runner.model, self._drafter) if isinstance(m, nn.Module)],
                lambda: _lora_slots(runner),
                lambda: [t for views in runner.kv_caches.values() for t in views],
            )
        return self._memory

    def _reload_from_checkpoint(self) -> None:
        """Read the weights again into this rank's (awake, empty) weight memory: a fresh load
        of the checkpoint copied in (it holds a second copy of the weights for that time)."""
        spec, runner = self.spec, self.spec.runner
        fresh = load_model(
            spec.model_config,
            spec.parallel,
            self.device,
            runner.load_format,
            runner.quantized_weight_mode,
        )
        targets = [m for m in (self.model_runner.model, self._drafter) if isinstance(m, nn.Module)]
        drafter = self._load_drafter(fresh) if self._drafter is not None else None
        copy_weights(targets, [m for m in (fresh, drafter) if m is not None])

    def cpu_threads(self) -> int:
        """Torch's intra-op threads in this rank's process."""
        return torch.get_num_threads()

    def shutdown(self) -> None:
        """Leave the process group (the model is freed with the worker)."""
        destroy_distributed()


def _lora_slots(runner: ModelRunner) -> list[torch.Tensor]:
    """The device slots of the LoRA adapters (none when LoRA is off)."""
    if runner.lora is None:
        return []
    return [t for layer in runner.lora.layers.values() for t in (layer.lora_a, layer.lora_b)]


def start_worker(spec: WorkerSpec) -> Worker:
    """A worker with its device, process group and model ready (all start-up phases but KV)."""
    worker = Worker(spec)
    worker.init_device()
    worker.load_model()
    return worker

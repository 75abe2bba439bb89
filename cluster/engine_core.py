"""The engine loop, in-process: schedule -> execute on the workers -> update from the output.

`EngineCore` owns the scheduler and an executor; `build_engine_core` wires them from the
per-package configs (workers report KV specs and memory, the KV cache config is built from
them, workers allocate it, the scheduler is sized by it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from cluster.engine_args import EngineConfigs
from cluster.executor import Executor, create_executor
from scheduler.kv_cache_config import build_kv_cache_config
from scheduler.kv_cache_spec import KVCacheConfig
from scheduler.output import RequestOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from worker.config import ParallelConfig
from worker.model_loader import check_parallel_layout
from worker.worker import WorkerSpec

logger = logging.getLogger(__name__)


class EngineCore:
    """One scheduler driving one group of workers, a step at a time."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, req_ids: Iterable[str]) -> list[RequestOutput]:
        return self.scheduler.abort(req_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the new tokens (and finishes) of the requests it touched."""
        scheduler_output = self.scheduler.schedule()
        try:
            runner_output = self.executor.execute(scheduler_output)
        except BaseException:
            self.scheduler.discard_failed_step(scheduler_output)  # no stale prefix-cache hits
            raise
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def shutdown(self) -> None:
        self.executor.shutdown()


def build_engine_core(configs: EngineConfigs) -> EngineCore:
    """Start the workers, size and allocate the KV cache, and create the scheduler."""
    spec = WorkerSpec(
        model_config=configs.model,
        parallel=ParallelConfig(tp_size=configs.tensor_parallel_size, rank=0),
        runner=configs.runner,
    )
    if spec.parallel.tp_size > 1:  # reject a layout before starting the rank processes
        _check_layout(spec)
    executor = create_executor(spec)
    try:
        kv_cache_config = _plan_kv_cache(executor, configs)
        executor.initialize_kv_cache(kv_cache_config)
        scheduler = Scheduler(configs.scheduler, kv_cache_config)
    except BaseException:
        executor.shutdown()
        raise
    return EngineCore(scheduler, executor)


def _check_layout(spec: WorkerSpec) -> None:
    try:
        check_parallel_layout(spec.model_config, spec.parallel)
    except ValueError as exc:
        raise ValueError(
            f"tensor_parallel_size={spec.parallel.tp_size} cannot split "
            f"{spec.model_config.architecture}: {exc}"
        ) from None


def _plan_kv_cache(executor: Executor, configs: EngineConfigs) -> KVCacheConfig:
    report = executor.determine_kv_cache_specs()
    memory = executor.available_kv_cache_memory()
    return build_kv_cache_config(
        report.layer_specs,
        memory,
        shared_kv_layers=report.shared_kv_layers,
        disable_hybrid=configs.disable_hybrid_kv_cache_manager,
        max_model_len=configs.model.max_model_len,
        max_num_batched_tokens=configs.scheduler.max_num_batched_tokens,
    )

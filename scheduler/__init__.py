"""Scheduler and hybrid KV cache coordinator: pure Python (no torch, no ray).

The engine builds a `Scheduler` from a `SchedulerConfig` and the `KVCacheConfig` the workers'
memory allows, then calls `add_request`, `schedule` and `update_from_output` each step.
"""

from scheduler.config import SchedulerConfig, SchedulingPolicy
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.output import (
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    RequestStepOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "FinishReason",
    "KVCacheManager",
    "ModelRunnerOutput",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "RequestStepOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulingPolicy",
    "TokenLogprobs",
    "build_kv_cache_config",
]

"""Scheduler statistics for metrics: one frozen snapshot per `Scheduler.make_stats()` call.

The engine turns these into gauges (requests, KV usage) and counters (prefix-cache queries and
hits, preemptions, evictions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.kv_cache.manager import KVCacheStats
    from scheduler.kv_cache.offload import OffloadCounters
    from scheduler.kv_cache.pressure import GroupPressure
    from scheduler.spec_decode import SpecDecodingStats


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler and its KV cache."""

    num_running_reqs: int
    """Requests holding KV blocks (admitted and not finished)."""
    num_waiting_reqs: int
    """Requests queued for admission, preempted ones included."""
    kv_cache_usage: float
    """Fraction of the usable pool held by requests, in [0, 1]."""
    kv_cache_usage_per_group: tuple[float, ...]
    """Fraction of the pool held by each KV cache group's block tables."""
    prefix_cache_queries: tuple[int, ...]
    """Per group: tokens of admitted requests looked up in the prefix cache, counted once per
    admission (cumulative)."""
    prefix_cache_hits: tuple[int, ...]
    """Per group: tokens of those lookups the group's own cache could serve, before the groups
    agree on one hit length (cumulative); shows which group limits reuse."""
    prefix_cache_hit_tokens: int
    """Prompt tokens actually served from the cache, all groups agreeing (cumulative)."""
    num_preemptions: int
    """Requests preempted since the scheduler started (cumulative)."""
    num_evictions: int
    """Cached blocks evicted to make room since the scheduler started (cumulative)."""
    num_waiting_for_kv_reqs: int = 0
    """Admitted requests waiting for their offload-tier loads (counted in `num_waiting_reqs`)."""
    prefix_cache_misses: tuple[tuple[tuple[str, int], ...], ...] = ()
    """Per group: tokens of admitted lookups the group could not serve, as (reason, tokens)
    pairs; reasons are `MissReason` values (cumulative)."""
    offload: OffloadCounters | None = None
    """The offload tier's usage, bytes stored and loaded, hit tokens per group (None: no tier)."""
    offload_load_seconds: float = 0.0
    """Summed wall time of the requests' offload-tier loads, issue to completion (cumulative)."""
    num_offload_loads: int = 0
    """Requests whose offload-tier loads completed (cumulative)."""
    spec_decoding: SpecDecodingStats | None = None
    """Speculative decoding acceptance counters (cumulative; None: speculation off)."""
    running_lora_adapters: tuple[str, ...] = ()
    """LoRA adapters of running requests (sorted)."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """LoRA adapters of waiting requests (sorted)."""
    max_lora: int = 0
    """The scheduler's adapter slots (0: LoRA off)."""
    max_concurrency: float = 0.0
    """Requests of `max_model_len` tokens the KV cache holds at once, each at its worst case
    over every group (windows and states at their most): vLLM's "Maximum concurrency". Set by
    the engine; inf for a model without KV memory."""
    group_pressure: tuple[GroupPressure, ...] = ()
    """Per KV cache group, in group order: blocks used, free (pool-wide) and reclaimable by
    eviction, and the `pressure` fraction; see `scheduler.kv_cache.pressure`. Empty: no KV
    cache groups."""
    admission_limited: tuple[tuple[str, int], ...] = ()
    """(label, steps) pairs, sorted by label (cumulative): steps whose admissions stopped while
    requests still waited, by what stopped them. A KV cache group's `<group_id>:<kind>` label
    (`GroupPressure.label`) when its block demand refused the queue's head, `max_num_seqs` when
    no seat was left, `token_budget` when the step's tokens were spent; at most one per step."""

    @classmethod
    def from_kv_stats(
        cls,
        kv_stats: KVCacheStats,
        *,
        num_running_reqs: int,
        num_waiting_reqs: int,
        num_preemptions: int,
        num_waiting_for_kv_reqs: int = 0,
        offload_loads: tuple[float, int] = (0.0, 0),
    ) -> SchedulerStats:
        """Combine the scheduler's counts with a KV cache manager snapshot."""
        return cls(
            num_running_reqs=num_running_reqs,
            num_waiting_reqs=num_waiting_reqs,
            kv_cache_usage=kv_stats.usage,
            kv_cache_usage_per_group=kv_stats.group_usage,
            prefix_cache_queries=kv_stats.query_tokens,
            prefix_cache_hits=kv_stats.group_hit_tokens,
            prefix_cache_hit_tokens=kv_stats.hit_tokens,
            num_preemptions=num_preemptions,
            num_evictions=kv_stats.num_evictions,
            prefix_cache_misses=kv_stats.group_miss_tokens,
            num_waiting_for_kv_reqs=num_waiting_for_kv_reqs,
            offload=kv_stats.offload,
            offload_load_seconds=offload_loads[0],
            num_offload_loads=offload_loads[1],
            group_pressure=kv_stats.group_pressure,
        )

"""Metrics of the KV offload tier, beside `EngineMetrics`: usage per tier, bytes stored and
loaded per tier, hit tokens per tier and KV cache group, load latency and requests waiting for
loads.

Names follow vLLM's `vllm:kv_offload_*` style, sanitized for Ray as in `cluster.serve.metrics`.
"""

from __future__ import annotations

from cluster.serve.ray_metric_names import counter as _counter
from cluster.serve.ray_metric_names import gauge as _gauge
from cluster.serve.ray_metric_names import inc_by_growth as _inc
from scheduler.kv_cache.offload import OffloadCounters
from scheduler.stats import SchedulerStats


class OffloadMetrics:
    """The offload-tier series of one model's engine (recorded only when it has a tier)."""

    def __init__(self, model_name: str) -> None:
        self.tags = {"model_name": model_name}
        self._last: SchedulerStats | None = None
        self.usage = _gauge("vllm:kv_offload_usage_perc", "Offload tier usage (1 = full).", "tier")
        self.used_bytes = _gauge("vllm:kv_offload_used_bytes", "Offload tier bytes held.", "tier")
        self.bytes = _counter(
            "vllm:kv_offload_bytes_total",
            "Bytes moved into (store) and out of (load) each offload tier.",
            "tier",
            "direction",
        )
        self.group_hits = _counter(
            "hybridserve:kv_offload_group_hit_tokens",
            "Hit tokens per offload tier and KV cache group served by blocks loaded from it.",
            "tier",
            "group",
        )
        self.load_seconds = _counter(
            "vllm:kv_offload_load_seconds_total", "Wall time of offload-tier loads (summed)."
        )
        self.loads = _counter("vllm:kv_offload_loads_total", "Requests that loaded from a tier.")
        self.failed = _counter(
            "vllm:kv_offload_failed_loads_total", "Offload-tier loads that failed (recomputed)."
        )
        self.waiting = _gauge(
            "vllm:num_requests_waiting_for_kvs", "Requests waiting for offload-tier loads."
        )

    def record(self, stats: SchedulerStats) -> None:
        """Gauges from a snapshot; counters by their growth since the last one."""
        now = stats.offload
        if now is None:
            return
        last = self._last.offload if self._last is not None else None
        tags = self.tags
        self.waiting.set(stats.num_waiting_for_kv_reqs, tags)
        for tier, used, capacity in (
            ("host", now.used_bytes, now.capacity_bytes),
            ("disk", now.disk_used_bytes, now.disk_capacity_bytes),
        ):
            self.used_bytes.set(used, {**tags, "tier": tier})
            self.usage.set(used / capacity if capacity else 0.0, {**tags, "tier": tier})
        moved_before = _moved(last) if last is not None else {}
        for (tier, direction), value in _moved(now).items():
            before = moved_before.get((tier, direction), 0)
            _inc(self.bytes, value, before, {**tags, "tier": tier, "direction": direction})
        hits_before = _group_hits(last) if last is not None else {}
        for (tier, group), hits in _group_hits(now).items():
            before = hits_before.get((tier, group), 0)
            _inc(self.group_hits, hits, before, {**tags, "tier": tier, "group": str(group)})
        previous = self._last
        _inc(self.failed, now.num_failed_loads, last.num_failed_loads if last else 0, tags)
        _inc(
            self.loads, stats.num_offload_loads, previous.num_offload_loads if previous else 0, tags
        )
        seconds = stats.offload_load_seconds - (previous.offload_load_seconds if previous else 0.0)
        if seconds > 0:
            self.load_seconds.inc(seconds, tags)
        self._last = stats


def _moved(counters: OffloadCounters) -> dict[tuple[str, str], int]:
    return {
        ("host", "store"): counters.stored_bytes,
        ("host", "load"): counters.loaded_bytes - counters.disk_loaded_bytes,
        ("disk", "store"): counters.disk_stored_bytes,
        ("disk", "load"): counters.disk_loaded_bytes,
    }


def _group_hits(counters: OffloadCounters) -> dict[tuple[str, int], int]:
    """Hit tokens by (tier, group)."""
    out: dict[tuple[str, int], int] = {}
    for group, total in enumerate(counters.group_hit_tokens):
        disk = counters.disk_group_hit_tokens[group] if counters.disk_group_hit_tokens else 0
        out[("host", group)] = total - disk
        out[("disk", group)] = disk
    return out

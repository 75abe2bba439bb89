"""The offload tier's Serve series: hit tokens per tier and group, bytes per tier and direction
and the waiting-for-KV gauge grow by each snapshot's new counts."""

from __future__ import annotations

from dataclasses import replace

from cluster.serve.metrics import EngineMetrics
from scheduler.kv_cache.offload import OffloadCounters
from scheduler.stats import SchedulerStats
from tests.helpers.recording_metrics import RecordingCounter, RecordingGauge, idle_stats


def _stats(host_hits: tuple[int, int], disk_hits: tuple[int, int]) -> SchedulerStats:
    counters = OffloadCounters(
        used_bytes=10,
        capacity_bytes=40,
        num_blocks=1,
        stored_bytes=100,
        loaded_bytes=60 + 10 * sum(disk_hits),
        group_hit_tokens=(host_hits[0] + disk_hits[0], host_hits[1] + disk_hits[1]),
        num_failed_loads=0,
        disk_loaded_bytes=10 * sum(disk_hits),
        disk_group_hit_tokens=disk_hits,
    )
    return replace(idle_stats(2), num_waiting_for_kv_reqs=1, offload=counters)


def test_hit_tokens_are_split_per_tier_and_group() -> None:
    metrics = EngineMetrics("m", ["full_attention", "sliding_window"])
    metrics.record_stats(_stats((16, 4), (0, 0)))
    assert metrics.offload is not None
    hits, moved, waiting = RecordingCounter(), RecordingCounter(), RecordingGauge()
    metrics.offload.group_hits, metrics.offload.bytes = hits, moved  # type: ignore[assignment]
    metrics.offload.waiting = waiting  # type: ignore[assignment]
    metrics.record_stats(_stats((48, 12), (32, 8)))
    assert hits.total(tier="host", group="0") == 32
    assert hits.total(tier="host", group="1") == 8
    assert hits.total(tier="disk", group="0") == 32
    assert hits.total(tier="disk", group="1") == 8
    assert moved.total(tier="disk", direction="load") == 400
    assert moved.total(tier="host", direction="load") == 0
    assert waiting.values == [(1, {"model_name": "m"})]

"""`hybridserve:prefix_cache_misses_total{group, reason}` grows by each snapshot's new misses."""

from __future__ import annotations

from dataclasses import replace

from cluster.serve.metrics import EngineMetrics, metric_name
from scheduler.stats import SchedulerStats
from tests.helpers.recording_metrics import RecordingCounter, idle_stats


def _stats(misses: tuple[tuple[tuple[str, int], ...], ...]) -> SchedulerStats:
    return replace(idle_stats(2), prefix_cache_misses=misses)


def test_miss_counters_grow_by_group_and_reason() -> None:
    metrics = EngineMetrics("m", ["full_attention", "sliding_window"])
    assert metric_name("hybridserve:prefix_cache_misses_total") in metrics.group_misses._name
    recorder = RecordingCounter()
    metrics.group_misses = recorder  # type: ignore[assignment]
    first = _stats(((("never_seen", 64),), (("never_seen", 64), ("evicted", 32))))
    metrics.record_stats(first)
    second = replace(
        first, prefix_cache_misses=((("never_seen", 80),), (("never_seen", 64), ("evicted", 48)))
    )
    metrics.record_stats(second)
    by_key = {}
    for value, tags in recorder.added:
        key = (tags["group"], tags["reason"])
        by_key[key] = by_key.get(key, 0) + value
        assert tags["model_name"] == "m"
    assert by_key == {("0", "never_seen"): 80, ("1", "never_seen"): 64, ("1", "evicted"): 48}


def test_offload_counters_grow_by_tier_direction_and_group() -> None:
    from scheduler.kv_cache.offload import OffloadCounters

    metrics = EngineMetrics("m", ["full_attention", "sliding_window"])
    first = OffloadCounters(100, 1000, 4, 400, 0, (0, 0), 0, 0, 2000, 0, 0, 0)
    second = OffloadCounters(100, 1000, 4, 500, 300, (8, 4), 1, 64, 2000, 2, 64, 128)
    metrics.record_stats(replace(_stats(((), ())), offload=first))
    assert metrics.offload is not None
    recorders = {name: RecordingCounter() for name in ("bytes", "group_hits", "failed", "loads")}
    for name, recorder in recorders.items():
        setattr(metrics.offload, name, recorder)
    metrics.record_stats(
        replace(_stats(((), ())), offload=second, num_offload_loads=3, offload_load_seconds=0.5)
    )
    moved = {(t["tier"], t["direction"]): v for v, t in recorders["bytes"].added}
    assert moved == {("host", "store"): 100, ("host", "load"): 236, ("disk", "load"): 64,
                     ("disk", "store"): 128}  # fmt: skip
    assert [(v, t["group"]) for v, t in recorders["group_hits"].added] == [(8, "0"), (4, "1")]
    assert [v for v, _ in recorders["failed"].added] == [1]
    assert [v for v, _ in recorders["loads"].added] == [3]

"""A replica's autoscaling report: per-group pressure of the shared pool and recent p90 TTFT."""

from __future__ import annotations

from dataclasses import replace

from cluster.serve.autoscaling_decision import ReplicaLoad
from cluster.serve.autoscaling_stats import RecentTTFT, autoscaling_stats, group_pressures
from scheduler.kv_cache.pressure import GroupPressure
from scheduler.stats import SchedulerStats


def _stats(per_group: tuple[float, ...], num_waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=1,
        num_waiting_reqs=num_waiting,
        kv_cache_usage=sum(per_group),
        kv_cache_usage_per_group=per_group,
        prefix_cache_queries=(0,) * len(per_group),
        prefix_cache_hits=(0,) * len(per_group),
        prefix_cache_hit_tokens=0,
        num_preemptions=0,
        num_evictions=0,
    )


KINDS = ("full_attention", "mamba")


def test_the_schedulers_group_pressure_is_reported_by_label() -> None:
    groups = (GroupPressure(0, "full_attention", 2, 6, 2), GroupPressure(1, "mamba", 7, 6, 0))
    stats = replace(_stats((0.2, 0.7)), group_pressure=groups)
    assert group_pressures(stats, KINDS) == {g.label: g.pressure for g in groups}


def test_without_it_a_full_pool_puts_every_holding_group_at_full_pressure() -> None:
    assert group_pressures(_stats((0.1, 0.9)), KINDS) == {"0:full_attention": 1.0, "1:mamba": 1.0}
    assert group_pressures(_stats((0.0, 1.0)), KINDS)["0:full_attention"] == 0.0


def test_without_it_the_group_holding_more_of_the_pool_is_under_more_pressure() -> None:
    pressures = group_pressures(_stats((0.1, 0.5)), KINDS)
    assert 0 < pressures["0:full_attention"] < pressures["1:mamba"] < 1


def test_recent_ttft_p90_forgets_old_requests() -> None:
    ttft = RecentTTFT(window_s=10.0)
    for index in range(10):
        ttft.observe(0.1 * (index + 1), now=100.0 + index)
    assert ttft.quantile(0.9, now=110.0) == 0.9
    assert ttft.quantile(0.9, now=130.0) == 0.0


def test_the_report_reads_back_as_the_replicas_load() -> None:
    ttft = RecentTTFT()
    ttft.observe(0.25)
    report = autoscaling_stats(_stats((0.2, 0.3), num_waiting=7), KINDS, ttft)
    load = ReplicaLoad.from_metrics(report)
    assert set(load.group_pressure) == {"0:full_attention", "1:mamba"}
    assert (load.num_waiting, load.ttft_p90_s) == (7.0, 0.25)

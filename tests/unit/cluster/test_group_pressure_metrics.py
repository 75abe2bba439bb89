"""The Serve engine's per-group block gauges and `hybridserve:admission_limited_total{group,
kind}` (grows by each snapshot's new steps), and both Grafana dashboards charting them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from cluster.serve.metrics import EngineMetrics, metric_name
from scheduler.kv_cache.pressure import GroupPressure
from tests.helpers.recording_metrics import RecordingCounter, RecordingGauge, idle_stats

ROOT = Path(__file__).resolve().parents[3]
KINDS = ["full_attention", "mamba"]
SERIES = [
    "ray_hybridserve_kv_cache_group_blocks",
    "ray_hybridserve_kv_cache_group_pressure",
    "ray_hybridserve_admission_limited_total",
]


def _groups(used: tuple[int, int], free: int, reclaimable: tuple[int, int]):  # type: ignore[no-untyped-def]
    return tuple(
        GroupPressure(group_id, kind, used[group_id], free, reclaimable[group_id])
        for group_id, kind in enumerate(KINDS)
    )


def test_group_blocks_and_pressure_are_gauges_by_group_kind_and_state() -> None:
    metrics = EngineMetrics("m", KINDS)
    assert metric_name("hybridserve:kv_cache_group_blocks") in metrics.group_blocks._name
    blocks, pressure = RecordingGauge(), RecordingGauge()
    metrics.group_blocks, metrics.group_pressure = blocks, pressure  # type: ignore[assignment]
    groups = _groups((6, 3), 10, (4, 7))
    metrics.record_stats(replace(idle_stats(2), group_pressure=groups))
    by_key = {(t["group"], t["kind"], t["state"]): v for v, t in blocks.values}
    for group in groups:
        key = (str(group.group_id), group.kind)
        assert by_key[(*key, "used")] == group.used
        assert by_key[(*key, "free")] == group.free
        assert by_key[(*key, "reclaimable")] == group.reclaimable
    assert {(t["group"], t["kind"]): v for v, t in pressure.values} == {
        (str(g.group_id), g.kind): g.pressure for g in groups
    }
    assert all(t["model_name"] == "m" for _, t in blocks.values + pressure.values)


def test_admission_limited_counter_grows_by_group_and_limit() -> None:
    metrics = EngineMetrics("m", KINDS)
    assert metric_name("hybridserve:admission_limited_total") in metrics.admission_limited._name
    recorder = RecordingCounter()
    metrics.admission_limited = recorder  # type: ignore[assignment]
    first = replace(idle_stats(2), admission_limited=(("1:mamba", 3),))
    second = replace(
        first, admission_limited=(("0:full_attention", 2), ("1:mamba", 5), ("max_num_seqs", 1))
    )
    metrics.record_stats(first)
    metrics.record_stats(second)
    assert recorder.total(group="1", kind="mamba") == 5
    assert recorder.total(group="0", kind="full_attention") == 2
    assert recorder.total(group="max_num_seqs", kind="max_num_seqs") == 1
    assert recorder.total() == 8


def test_both_dashboards_chart_the_group_blocks_pressure_and_admission_limits() -> None:
    for path in ("helm/hybridserve/dashboards/hybridserve.json",
                 "docs/grafana/hybridserve-dashboard.json"):  # fmt: skip
        panels = json.loads((ROOT / path).read_text())["panels"]
        exprs = [target["expr"] for panel in panels for target in panel.get("targets", [])]
        for series in SERIES:
            assert any(series in expr for expr in exprs), f"{series} is not charted in {path}"

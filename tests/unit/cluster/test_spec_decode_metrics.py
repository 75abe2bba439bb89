"""Speculative decoding metrics under vLLM's names: the Serve counters grow by each snapshot's
new drafts and acceptances (per position too), and the offline reader lists them."""

from __future__ import annotations

from dataclasses import replace

from cluster.engine.metric_reader import Counter, Vector, read_metrics
from cluster.serve.metrics import EngineMetrics, metric_name
from scheduler.spec_decode import SpecDecodingStats
from scheduler.stats import SchedulerStats
from tests.helpers.recording_metrics import RecordingCounter, idle_stats


def _stats(spec: SpecDecodingStats | None) -> SchedulerStats:
    return replace(idle_stats(1), spec_decoding=spec)


def test_serve_counters_grow_by_each_snapshot() -> None:
    metrics = EngineMetrics("m", ["full_attention"])
    assert metric_name("vllm:spec_decode_num_drafts") in metrics.spec.drafts._name
    names = ("drafts", "draft_tokens", "accepted", "per_pos")
    recorders = {name: RecordingCounter() for name in names}
    for name, recorder in recorders.items():
        setattr(metrics.spec, name, recorder)
    metrics.record_stats(_stats(SpecDecodingStats(2, 6, 3, (2, 1, 0))))
    metrics.record_stats(_stats(SpecDecodingStats(5, 15, 7, (4, 2, 1))))
    assert recorders["drafts"].total(model_name="m") == 5
    assert recorders["draft_tokens"].total() == 15
    assert recorders["accepted"].total() == 7
    per_pos = recorders["per_pos"]
    assert [per_pos.total(position=str(pos)) for pos in range(3)] == [4, 2, 1]


def test_offline_reader_lists_spec_decode_metrics_only_when_on() -> None:
    metrics = {m.name: m for m in read_metrics(_stats(SpecDecodingStats(5, 15, 7, (4, 2, 1))))}
    assert metrics["vllm:spec_decode_num_drafts"] == Counter("vllm:spec_decode_num_drafts", 5)
    assert metrics["vllm:spec_decode_num_accepted_tokens"].value == 7  # type: ignore[attr-defined]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos == Vector("vllm:spec_decode_num_accepted_tokens_per_pos", [4, 2, 1])
    names = {m.name for m in read_metrics(_stats(None))}
    assert "vllm:prefix_cache_hits" in names
    assert not any(name.startswith("vllm:spec_decode") for name in names)

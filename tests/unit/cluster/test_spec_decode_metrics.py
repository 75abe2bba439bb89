"""Speculative decoding metrics under vLLM's names: the Serve counters grow by each snapshot's
new drafts and acceptances (per position too), and the offline reader lists them."""

from __future__ import annotations

from cluster.engine.metric_reader import Counter, Vector, read_metrics
from cluster.serve.metrics import EngineMetrics, metric_name
from scheduler.spec_decode import SpecDecodingStats
from scheduler.stats import SchedulerStats


class RecordingCounter:
    """Keeps what the engine adds to a Ray counter (the exporter is not under test)."""

    def __init__(self) -> None:
        self.added: list[tuple[int, dict[str, str]]] = []

    def inc(self, value: int, tags: dict[str, str]) -> None:
        self.added.append((value, tags))

    def total(self, **tags: str) -> int:
        return sum(v for v, t in self.added if all(t.get(k) == w for k, w in tags.items()))


def _stats(spec: SpecDecodingStats | None) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=1,
        num_waiting_reqs=0,
        kv_cache_usage=0.5,
        kv_cache_usage_per_group=(0.5,),
        prefix_cache_queries=(10,),
        prefix_cache_hits=(4,),
        prefix_cache_hit_tokens=4,
        num_preemptions=0,
        num_evictions=0,
        spec_decoding=spec,
    )


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

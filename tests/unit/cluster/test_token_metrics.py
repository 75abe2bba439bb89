"""Generated tokens and inter-token latencies reach Ray's metrics in batches, none lost."""

from __future__ import annotations

from cluster.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from cluster.serve.metrics import EngineMetrics


class RecordingMetric:
    """What the engine hands to a Ray counter or histogram (the exporter is not under test)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(value)

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(value)


def _delta(tokens: list[int], latencies: list[float], finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        outputs=[CompletionOutput(0, "x" * len(tokens), tokens, finish_reason=None)],
        finished=finished,
        metrics=RequestMetrics(arrival_time=0.0, inter_token_latencies=latencies),
    )


def _recording_metrics() -> tuple[EngineMetrics, RecordingMetric, RecordingMetric]:
    metrics = EngineMetrics("m", ["full_attention"])
    tokens, itl = RecordingMetric(), RecordingMetric()
    metrics.generation_tokens = tokens  # type: ignore[assignment]
    metrics.itl = itl  # type: ignore[assignment]
    return metrics, tokens, itl


def test_tokens_wait_for_a_flush_then_arrive_in_one_call() -> None:
    metrics, tokens, itl = _recording_metrics()
    for step in range(5):
        metrics.record_tokens(_delta([step, step + 1], [0.01 * step]))
    assert tokens.calls == []
    assert itl.calls == []
    metrics.flush_tokens()
    assert tokens.calls == [10]
    assert itl.calls == [0.0, 0.01, 0.02, 0.03, 0.04]
    metrics.flush_tokens()  # nothing new: nothing recorded
    assert tokens.calls == [10]
    assert len(itl.calls) == 5


def test_a_finished_request_flushes_its_tokens() -> None:
    metrics, tokens, itl = _recording_metrics()
    metrics.record_tokens(_delta([7], [0.5]))
    metrics.record_finished(_delta([7], [], finished=True))
    assert tokens.calls == [1]
    assert itl.calls == [0.5]

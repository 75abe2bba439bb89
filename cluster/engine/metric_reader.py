"""The offline API's metrics (`LLM.get_metrics()`), vLLM's reader shapes and names: counters,
gauges and vectors read from one scheduler snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.stats import SchedulerStats


@dataclass(frozen=True)
class Metric:
    """A named metric (vLLM's `vllm:*` names)."""

    name: str


@dataclass(frozen=True)
class Counter(Metric):
    """A cumulative count."""

    value: int


@dataclass(frozen=True)
class Gauge(Metric):
    """A current value."""

    value: float


@dataclass(frozen=True)
class Vector(Metric):
    """Cumulative counts by position (`vllm:spec_decode_num_accepted_tokens_per_pos`)."""

    values: list[int]


def read_metrics(stats: SchedulerStats) -> list[Metric]:
    """The engine's metrics from a scheduler snapshot."""
    metrics: list[Metric] = [
        Gauge("vllm:num_requests_running", stats.num_running_reqs),
        Gauge("vllm:num_requests_waiting", stats.num_waiting_reqs),
        Gauge("vllm:kv_cache_usage_perc", stats.kv_cache_usage),
        Counter("vllm:prefix_cache_queries", sum(stats.prefix_cache_queries)),
        Counter("vllm:prefix_cache_hits", stats.prefix_cache_hit_tokens),
        Counter("vllm:num_preemptions", stats.num_preemptions),
        Gauge("hybridserve:max_concurrency", stats.max_concurrency),
    ]
    spec = stats.spec_decoding
    if spec is not None:
        metrics += [
            Counter("vllm:spec_decode_num_drafts", spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", spec.num_accepted_tokens),
            Vector(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                list(spec.num_accepted_tokens_per_pos),
            ),
        ]
    return metrics

"""The offline API's metrics (`LLM.get_metrics()`), vLLM's reader shapes and names: counters,
gauges and vectors read from one scheduler snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.kv_cache.pressure import GroupPressure
from scheduler.stats import SchedulerStats

GROUP_BLOCKS = "hybridserve:kv_cache_group_blocks"
"""Blocks of a KV cache group by `state`: used, free (pool-wide) or reclaimable by eviction."""
GROUP_PRESSURE = "hybridserve:kv_cache_group_pressure"
"""`GroupPressure.pressure` of a KV cache group."""
ADMISSION_LIMITED = "hybridserve:admission_limited_total"
"""Steps whose admissions stopped with requests waiting, by what stopped them."""


@dataclass(frozen=True)
class Metric:
    """A named metric (vLLM's `vllm:*` names) and its labels (vLLM's reader has them too)."""

    name: str
    labels: dict[str, str] = field(default_factory=dict, kw_only=True)
    """The series' labels besides the model: `group` and `kind` of per-group series."""


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
    for group in stats.group_pressure:
        metrics += _group_gauges(group)
    for label, steps in stats.admission_limited:
        metrics.append(Counter(ADMISSION_LIMITED, steps, labels=admission_labels(label)))
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


def _group_gauges(group: GroupPressure) -> list[Metric]:
    labels = {"group": str(group.group_id), "kind": group.kind}
    return [
        *(
            Gauge(GROUP_BLOCKS, blocks, labels={**labels, "state": state})
            for state, blocks in group_block_states(group)
        ),
        Gauge(GROUP_PRESSURE, group.pressure, labels=labels),
    ]


def group_block_states(group: GroupPressure) -> tuple[tuple[str, int], ...]:
    """The `state` label values of `hybridserve:kv_cache_group_blocks` and their blocks."""
    return (("used", group.used), ("free", group.free), ("reclaimable", group.reclaimable))


def admission_labels(label: str) -> dict[str, str]:
    """`group` and `kind` labels of an `admission_limited` key: a KV cache group's `1:mamba`
    gives group `1`, kind `mamba`; `max_num_seqs` and `token_budget` give both that name."""
    group, _, kind = label.partition(":")
    return {"group": group, "kind": kind or group}

"""Ray metric objects under vLLM's names: ':' is not accepted by Ray, so names are sanitized as
vLLM does on Ray (`vllm:num_requests_running` -> `vllm_num_requests_running`); every series
has a `model_name` label."""

from __future__ import annotations

from ray.util import metrics


def metric_name(name: str) -> str:
    """The name Ray accepts: ':' becomes '_' (vLLM's sanitizing on Ray)."""
    return name.replace(":", "_")


def gauge(name: str, doc: str, *tags: str) -> metrics.Gauge:
    return metrics.Gauge(metric_name(name), doc, tag_keys=("model_name", *tags))


def counter(name: str, doc: str, *tags: str) -> metrics.Counter:
    return metrics.Counter(metric_name(name), doc, tag_keys=("model_name", *tags))


def inc_by_growth(
    counter: metrics.Counter, now: float, before: float, tags: dict[str, str]
) -> None:
    """Add to `counter` what a cumulative count grew by since `before` (nothing if it did not)."""
    if now > before:
        counter.inc(now - before, tags)

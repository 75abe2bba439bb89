"""Engine metrics through `ray.util.metrics`, under vLLM's names with a `model_name` label.

Ray no longer accepts ':' in metric names, so names are sanitized as vLLM does on Ray
(`vllm:num_requests_running` -> `vllm_num_requests_running`), and Ray's exporter adds its `ray_`
prefix: `ray_vllm_num_requests_running`, as Ray's "Serve LLM" dashboard expects. The
`hybridserve:` series (per-KV-group usage and hits, worker liveness) follow the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from ray.util import metrics

from cluster.engine.metric_reader import (
    ADMISSION_LIMITED,
    GROUP_BLOCKS,
    GROUP_PRESSURE,
    admission_labels,
    group_block_states,
)
from cluster.engine.outputs import RequestOutput
from cluster.serve.offload_metrics import OffloadMetrics
from cluster.serve.ray_metric_names import counter as _counter
from cluster.serve.ray_metric_names import gauge as _gauge
from cluster.serve.ray_metric_names import inc_by_growth as _inc
from cluster.serve.ray_metric_names import metric_name
from scheduler.spec_decode import SpecDecodingStats
from scheduler.stats import SchedulerStats

__all__ = ["EngineMetrics", "metric_name"]

TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]  # fmt: skip
ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]  # fmt: skip
LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]  # fmt: skip


def _histogram(name: str, doc: str, buckets: list[float]) -> metrics.Histogram:
    return metrics.Histogram(metric_name(name), doc, boundaries=buckets, tag_keys=("model_name",))


class EngineMetrics:
    """The metrics of one model's engine in one replica."""

    def __init__(self, model_name: str, group_kinds: Sequence[str]) -> None:
        self.tags = {"model_name": model_name}
        self.group_kinds = list(group_kinds)
        self._last: SchedulerStats | None = None
        self._unflushed_tokens = 0
        self._unflushed_itls: list[float] = []
        self.running = _gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = _gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.pc_queries = _counter("vllm:prefix_cache_queries", "Prefix-cache lookups (tokens).")
        self.pc_hits = _counter("vllm:prefix_cache_hits", "Prefix-cache hits (tokens).")
        self.preemptions = _counter("vllm:num_preemptions_total", "Preemptions (cumulative).")
        self.prompt_tokens = _counter("vllm:prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = _counter("vllm:generation_tokens_total", "Tokens generated.")
        self.success = _counter(
            "vllm:request_success_total", "Finished requests.", "finished_reason"
        )
        self.ttft = _histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self.itl = _histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS
        )
        self.e2e = _histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self.queue = _histogram(
            "vllm:request_queue_time_seconds", "Time waiting before scheduling.", LATENCY_BUCKETS
        )
        self.group_usage = _gauge(
            "hybridserve:kv_cache_group_usage_perc", "KV usage per KV cache group.", "group", "kind"
        )
        self.group_hits = _counter(
            "hybridserve:prefix_cache_group_hits",
            "Prefix-cache hit tokens per KV cache group, before groups agree.",
            "group",
        )
        self.group_misses = _counter(
            "hybridserve:prefix_cache_misses_total",
            "Prompt tokens a KV cache group could not serve from the prefix cache, by reason.",
            "group",
            "reason",
        )
        self.group_blocks = _gauge(
            GROUP_BLOCKS,
            "KV cache blocks per group: used, free (pool-wide) or reclaimable by eviction.",
            "group",
            "kind",
            "state",
        )
        self.group_pressure = _gauge(
            GROUP_PRESSURE, "used / (used + free + reclaimable) per group.", "group", "kind"
        )
        self.admission_limited = _counter(
            ADMISSION_LIMITED,
            "Steps whose admissions stopped with requests waiting, by the KV cache group (or "
            "max_num_seqs, token_budget) that stopped them.",
            "group",
            "kind",
        )
        self.worker_alive = _gauge("hybridserve:worker_alive", "1 if the rank is alive.", "rank")
        self.offload: OffloadMetrics | None = None
        """The offload tier's series, made at the first snapshot that has a tier."""
        self.spec = SpecDecodeMetrics(self.tags)
        for counter in (
            self.pc_queries,
            self.pc_hits,
            self.preemptions,
            self.prompt_tokens,
            self.generation_tokens,
        ):
            # Export the series at 0 from the start (Counter.inc refuses 0), so dashboards and
            # rate() see it before the first event.
            counter._record(0, tags=self.tags)

    def record_stats(self, stats: SchedulerStats) -> None:
        """Gauges from a scheduler snapshot; counters by their growth since the last one."""
        tags = self.tags
        self.flush_tokens()
        self.running.set(stats.num_running_reqs, tags)
        self.waiting.set(stats.num_waiting_reqs, tags)
        self.kv_usage.set(stats.kv_cache_usage, tags)
        last = self._last
        _inc(self.pc_queries, sum(stats.prefix_cache_queries), _sum(last, "queries"), tags)
        _inc(self.pc_hits, stats.prefix_cache_hit_tokens, _sum(last, "hits"), tags)
        _inc(self.preemptions, stats.num_preemptions, _sum(last, "preemptions"), tags)
        for group, usage in enumerate(stats.kv_cache_usage_per_group):
            kind = self.group_kinds[group] if group < len(self.group_kinds) else "unknown"
            self.group_usage.set(usage, {**tags, "group": str(group), "kind": kind})
        for group, hits in enumerate(stats.prefix_cache_hits):
            before = last.prefix_cache_hits[group] if last is not None else 0
            _inc(self.group_hits, hits, before, {**tags, "group": str(group)})
        self._record_misses(stats, last)
        self._record_pressure(stats, last)
        if stats.offload is not None:
            if self.offload is None:
                self.offload = OffloadMetrics(tags["model_name"])
            self.offload.record(stats)
        if stats.spec_decoding is not None:
            self.spec.record(stats.spec_decoding)
        self._last = stats

    def _record_misses(self, stats: SchedulerStats, last: SchedulerStats | None) -> None:
        before = last.prefix_cache_misses if last is not None else ()
        for group, misses in enumerate(stats.prefix_cache_misses):
            earlier = dict(before[group]) if group < len(before) else {}
            for reason, tokens in misses:
                tags = {**self.tags, "group": str(group), "reason": reason}
                _inc(self.group_misses, tokens, earlier.get(reason, 0), tags)

    def _record_pressure(self, stats: SchedulerStats, last: SchedulerStats | None) -> None:
        for group in stats.group_pressure:
            tags = {**self.tags, "group": str(group.group_id), "kind": group.kind}
            for state, blocks in group_block_states(group):
                self.group_blocks.set(blocks, {**tags, "state": state})
            self.group_pressure.set(group.pressure, tags)
        before = dict(last.admission_limited) if last is not None else {}
        for label, steps in stats.admission_limited:
            tags = {**self.tags, **admission_labels(label)}
            _inc(self.admission_limited, steps, before.get(label, 0), tags)

    def record_workers(self, alive: Sequence[bool]) -> None:
        for rank, up in enumerate(alive):
            self.worker_alive.set(1.0 if up else 0.0, {**self.tags, "rank": str(rank)})

    def record_tokens(self, delta: RequestOutput) -> None:
        """Per stream item: generated tokens and their inter-token latencies, kept here until
        `flush_tokens` (a Ray metric call per stream item was most of the replica's own cost
        per token)."""
        self._unflushed_tokens += sum(len(part.token_ids) for part in delta.outputs)
        if delta.metrics is not None:
            self._unflushed_itls.extend(delta.metrics.inter_token_latencies)

    def flush_tokens(self) -> None:
        """Hand the tokens and latencies kept since the last flush to Ray's metrics."""
        if self._unflushed_tokens:
            self.generation_tokens.inc(self._unflushed_tokens, self.tags)
            self._unflushed_tokens = 0
        latencies, self._unflushed_itls = self._unflushed_itls, []
        for latency in latencies:
            self.itl.observe(latency, self.tags)

    def record_finished(self, output: RequestOutput) -> None:
        """Once per request: prompt tokens, latencies and finish reasons (and the tokens kept
        since the last flush, so a finished request's tokens are exported with it)."""
        self.flush_tokens()
        tags = self.tags
        self.prompt_tokens.inc(len(output.prompt_token_ids), tags)
        for part in output.outputs:
            reason = part.finish_reason or "abort"
            self.success.inc(1, {**tags, "finished_reason": reason})
        timing = output.metrics
        if timing is None:
            return
        for histogram, value in (
            (self.ttft, timing.time_to_first_token),
            (self.e2e, timing.e2e_latency),
            (self.queue, timing.queue_time),
        ):
            if value is not None:
                histogram.observe(max(value, 0.0), tags)


class SpecDecodeMetrics:
    """vLLM's speculative decoding counters, by their growth since the last snapshot."""

    def __init__(self, tags: dict[str, str]) -> None:
        self.tags = tags
        self.drafts = _counter("vllm:spec_decode_num_drafts", "Verify steps with drafts.")
        self.draft_tokens = _counter("vllm:spec_decode_num_draft_tokens", "Draft tokens.")
        self.accepted = _counter("vllm:spec_decode_num_accepted_tokens", "Accepted drafts.")
        self.per_pos = _counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by draft position.",
            "position",
        )
        self._last = SpecDecodingStats()

    def record(self, stats: SpecDecodingStats) -> None:
        last, tags = self._last, self.tags
        _inc(self.drafts, stats.num_drafts, last.num_drafts, tags)
        _inc(self.draft_tokens, stats.num_draft_tokens, last.num_draft_tokens, tags)
        _inc(self.accepted, stats.num_accepted_tokens, last.num_accepted_tokens, tags)
        before = last.num_accepted_tokens_per_pos
        for pos, count in enumerate(stats.num_accepted_tokens_per_pos):
            earlier = before[pos] if pos < len(before) else 0
            _inc(self.per_pos, count, earlier, {**tags, "position": str(pos)})
        self._last = stats


def _sum(stats: SchedulerStats | None, what: str) -> int:
    if stats is None:
        return 0
    if what == "queries":
        return sum(stats.prefix_cache_queries)
    if what == "hits":
        return stats.prefix_cache_hit_tokens
    return stats.num_preemptions

"""Metrics of KV transfers between engines (P/D hand-offs and pulls from a peer), beside
`EngineMetrics`: bytes and blocks sent and received per KV cache group, transfer time, failed
imports, and requests served by a transfer or by a recompute.

vLLM names transfer metrics per connector (`vllm:nixl_xfer_time_seconds`,
`vllm:nixl_bytes_transferred`, `vllm:nixl_num_failed_transfers`); these follow its
`vllm:kv_*` style with a `group` label the connectors lack, sanitized for Ray.
"""

from __future__ import annotations

from cluster.engine.kv_transfer_counters import KVTransferCounters
from cluster.serve.ray_metric_names import counter as _counter
from cluster.serve.ray_metric_names import inc_by_growth as _inc


class TransferMetrics:
    """The transfer series of one model's engine."""

    def __init__(self, model_name: str, num_groups: int) -> None:
        self.tags = {"model_name": model_name}
        self._last = KVTransferCounters(num_groups)
        self.bytes = _counter(
            "vllm:kv_transfer_bytes_total",
            "KV bytes sent to and received from other engines, per KV cache group.",
            "group",
            "direction",
        )
        self.blocks = _counter(
            "vllm:kv_transfer_blocks_total",
            "KV blocks sent to and received from other engines, per KV cache group.",
            "group",
            "direction",
        )
        self.seconds = _counter(
            "vllm:kv_transfer_seconds_total",
            "Wall time of exports (send) and imports (receive), summed.",
            "direction",
        )
        self.failed = _counter(
            "vllm:kv_transfer_failed_total", "Imports that took nothing (the prompt recomputes)."
        )
        self.requests = _counter(
            "hybridserve:kv_transfer_requests_total",
            "Requests whose prefix came from another engine (pull) or was recomputed after a "
            "failed or late transfer (recompute).",
            "outcome",
        )

    def record(self, now: KVTransferCounters) -> None:
        """Counters by their growth since the last call."""
        last, tags = self._last, self.tags
        for direction, blocks, sizes, blocks_before, sizes_before in (
            ("send", now.blocks_sent, now.bytes_sent, last.blocks_sent, last.bytes_sent),
            (
                "receive",
                now.blocks_received,
                now.bytes_received,
                last.blocks_received,
                last.bytes_received,
            ),
        ):
            for group in range(now.num_groups):
                group_tags = {**tags, "group": str(group), "direction": direction}
                _inc(self.blocks, blocks[group], blocks_before[group], group_tags)
                _inc(self.bytes, sizes[group], sizes_before[group], group_tags)
        _inc(self.seconds, now.export_seconds, last.export_seconds, {**tags, "direction": "send"})
        receive = {**tags, "direction": "receive"}
        _inc(self.seconds, now.import_seconds, last.import_seconds, receive)
        _inc(self.failed, now.num_failed_imports, last.num_failed_imports, tags)
        _inc(self.requests, now.num_pulls, last.num_pulls, {**tags, "outcome": "pull"})
        recompute = {**tags, "outcome": "recompute"}
        _inc(self.requests, now.num_recomputes, last.num_recomputes, recompute)
        self._last = now.snapshot()

"""Cumulative counters of an engine's KV transfers with other engines (per KV cache group),
read by the metrics exporter."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class KVTransferCounters:
    """Cumulative transfer counters of one engine (never reset on read)."""

    num_groups: int
    blocks_sent: list[int] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    blocks_received: list[int] = field(default_factory=list)
    bytes_received: list[int] = field(default_factory=list)
    num_exports: int = 0
    num_imports: int = 0
    num_failed_imports: int = 0
    """Imports that took nothing (no room, or the pages could not be written)."""
    export_seconds: float = 0.0
    import_seconds: float = 0.0
    num_pulls: int = 0
    """Requests whose prefix came from another engine (a P/D hand-off or a pull)."""
    num_recomputes: int = 0
    """Requests that computed their prefix here because the transfer failed or timed out."""
    num_pulls_in_flight: int = 0
    """Requests waiting for their prefix from another engine now (counted until it is imported
    or given up)."""
    num_offers: int = 0
    """Exports whose shards the ranks offered over direct connections (the direct transport)."""
    num_sends_pending: int = 0
    """Offered shards whose pages the ranks still hold (read from the ranks on a snapshot)."""
    num_failed_sends: int = 0
    """Offered shards the ranks dropped: nobody took them in time, or the receiver broke off
    (read from the ranks on a snapshot)."""

    def __post_init__(self) -> None:
        for counts in (
            self.blocks_sent,
            self.bytes_sent,
            self.blocks_received,
            self.bytes_received,
        ):
            counts.extend([0] * (self.num_groups - len(counts)))

    def snapshot(self) -> KVTransferCounters:
        """A copy that later transfers do not change."""
        return replace(
            self,
            blocks_sent=list(self.blocks_sent),
            bytes_sent=list(self.bytes_sent),
            blocks_received=list(self.blocks_received),
            bytes_received=list(self.bytes_received),
        )

"""Cumulative counters of an engine's KV transfers with other engines (per KV cache group),
read by the metrics exporter."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        for counts in (
            self.blocks_sent,
            self.bytes_sent,
            self.blocks_received,
            self.bytes_received,
        ):
            counts.extend([0] * (self.num_groups - len(counts)))

"""The weight version an engine runs, and the block-hash root it gives every prefix-cache key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.block_hash import BlockHash, weights_root


@dataclass
class WeightVersion:
    """The engine's current weight version (None: the weights loaded at start-up)."""

    version: str | None = None
    num_updates: int = 0
    """Weight updates applied since start-up."""
    root: BlockHash = field(default_factory=lambda: weights_root(None))
    """Parent of block 0 of every block hash computed under these weights."""
    transfer_config: Any = None
    """The engine's `weight_transfer_config` (None: the defaults)."""
    transfer: Any = None
    """The weight-transfer state of `cluster.engine.weight_sync` (set up on first use)."""

    def advance(self, version: str | int | None) -> str:
        """Move to `version` (None: the number of updates so far); the new version."""
        self.num_updates += 1
        new = str(self.num_updates) if version is None else str(version)
        self.version = new
        self.root = weights_root(new)
        return new

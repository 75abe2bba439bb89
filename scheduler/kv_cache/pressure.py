"""Per KV cache group capacity (used / free / reclaimable blocks) and which group limited
admission: the snapshot `Scheduler.make_stats` reports and the counter the scheduler keeps.

One `BlockPool` serves every group, so a block belongs to a group only while that group's
tables hold it (used) or while it keeps that group's cached data with no holder (reclaimable):

    usable blocks (pool minus the null block)
    ├── used[g]         ref count > 0, handed to group g's tables
    ├── reclaimable[g]  ref count 0, still registered in group g's prefix cache (evictable)
    └── free            ref count 0, no cached data: any group takes these first (pool-wide)

    sum(used) + free + sum(reclaimable) == usable blocks
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.spec import KVCacheSpec

MAX_NUM_SEQS = "max_num_seqs"
"""`admission_limited` label: the running set had no seat left (`max_num_seqs`)."""
TOKEN_BUDGET = "token_budget"
"""`admission_limited` label: the step's token budget was spent before the queue emptied."""


@dataclass(frozen=True)
class GroupPressure:
    """Capacity of one KV cache group at one moment, in blocks of the shared pool."""

    group_id: int
    """Index of the group in the KV cache config (the `group` label of per-group metrics)."""
    kind: str
    """The group's spec kind: `full_attention`, `sliding_window`, `chunked_local`, `mamba`,
    `gated_delta_net`, ... (the `kind` label)."""
    used: int
    """Blocks the group's block tables hold (reference count > 0)."""
    free: int
    """Blocks holding no cached data, pool-wide: the same number for every group, since any
    group takes any of them."""
    reclaimable: int
    """The group's cached blocks nobody holds (reference count 0, still in its prefix cache):
    evicted, oldest first, when free blocks run out."""

    @property
    def label(self) -> str:
        """`<group_id>:<kind>`, the key of this group in `SchedulerStats.admission_limited`."""
        return group_label(self.group_id, self.kind)

    @property
    def pressure(self) -> float:
        """`used / (used + free + reclaimable)`, in [0, 1]: how much of the blocks this group
        holds or can take without evicting another group's cache it already holds (1: no free
        block left and nothing of its own to evict; 0: the group holds nothing)."""
        total = self.used + self.free + self.reclaimable
        return self.used / total if total else 0.0


def group_label(group_id: int, kind: str) -> str:
    """A KV cache group's readable, stable key: its index and its spec kind (`1:mamba`)."""
    return f"{group_id}:{kind}"


def group_pressure(pool: BlockPool, specs: Sequence[KVCacheSpec]) -> tuple[GroupPressure, ...]:
    """Used, free and reclaimable blocks of every group (one pass over the pool's blocks)."""
    kinds = [spec.kind for spec in specs]
    num_groups = len(kinds)
    used = [0] * num_groups
    reclaimable = [0] * num_groups
    for block in pool.blocks[1:]:
        if block.ref_cnt > 0:
            used[block.group_id] += 1
        elif block.block_hash is not None:
            reclaimable[block.group_id] += 1
    free = pool.num_free_blocks - sum(reclaimable)
    return tuple(
        GroupPressure(group_id, kind, used[group_id], free, reclaimable[group_id])
        for group_id, kind in enumerate(kinds)
    )


def responsible_group(demand: Sequence[int], used: Sequence[float]) -> int:
    """The group a refused allocation is charged to: the largest block demand; on a tie, the
    group holding the most blocks; then the lowest index."""
    return min(range(len(demand)), key=lambda group_id: (-demand[group_id], -used[group_id]))


class AdmissionLimits:
    """Cumulative count, by label, of the steps whose admissions stopped with requests still
    waiting: a KV cache group's label (`group_label`), `max_num_seqs` or `token_budget`."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def record(self, label: str | None) -> None:
        """Count one step stopped by `label` (None: not stopped, or for another reason)."""
        if label is not None:
            self._counts[label] = self._counts.get(label, 0) + 1

    def snapshot(self) -> tuple[tuple[str, int], ...]:
        """(label, steps) pairs, sorted by label."""
        return tuple(sorted(self._counts.items()))


def non_kv_limit(is_waiting: bool, budget: int) -> str | None:
    """What ended an admission loop that ran out of token budget or seats (None: nothing is
    left waiting)."""
    if not is_waiting:
        return None
    return TOKEN_BUDGET if budget <= 0 else MAX_NUM_SEQS

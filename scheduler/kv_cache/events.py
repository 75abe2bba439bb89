"""KV cache events: which prefix-cache keys (block hash, group) appeared and disappeared.

The `BlockPool` calls an attached `KVEventSink` where a key enters its hash map and where it leaves
(a duplicate block taking over a key changes nothing, so the events mirror the set of keys a
lookup can find). The engine takes one `KVEventBatch` per step; a router replays the batches
into a `CacheIndex` to predict each replica's hit. Off unless a sink is attached.

With each step the engine also gives its `EvictionOutlook`: the keys its pool would evict next,
in its eviction policy's order, so that a router whose events arrive a poll period late can
drop what the engine evicts meanwhile for the requests the router has sent it since.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.block_hash import SEED, BlockHash
from scheduler.kv_cache.spec import KVCacheGroupSpec


@dataclass(frozen=True)
class KVEventBatch:
    """The net change of one engine's prefix-cache keys over one step (or a few).

    Replay order: if `cleared`, forget every key; then drop `removed`, then add `stored`
    (disjoint per group).
    """

    stored: tuple[tuple[BlockHash, ...], ...]
    """Per group, keys now findable that were not at the start of the batch."""
    removed: tuple[tuple[BlockHash, ...], ...]
    """Per group, keys no longer findable."""
    cleared: bool = False
    """Every key was dropped (prefix cache reset) before the keys in `stored` came."""
    tier_stored: tuple[tuple[BlockHash, ...], ...] = ()
    """Per group, keys the offload tier (host or disk) now holds; empty without a tier. A hit
    on them costs a load: a router scores them below keys on the device."""
    tier_removed: tuple[tuple[BlockHash, ...], ...] = ()
    """Per group, keys the offload tier no longer holds."""
    hash_root: BlockHash = SEED
    """The root the engine's block hashes chain from (its weight version's): a router hashes
    prompts from it to predict hits."""

    @property
    def num_keys(self) -> int:
        lists = (self.stored, self.removed, self.tier_stored, self.tier_removed)
        return sum(sum(map(len, per_group)) for per_group in lists)


class KVEventSink:
    """Collects key changes between two `take()`s as net per-group sets."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self._stored: list[dict[BlockHash, None]] = [{} for _ in range(num_groups)]
        self._removed: list[dict[BlockHash, None]] = [{} for _ in range(num_groups)]
        self._tier_stored: list[dict[BlockHash, None]] = [{} for _ in range(num_groups)]
        self._tier_removed: list[dict[BlockHash, None]] = [{} for _ in range(num_groups)]
        self._cleared = False
        self.hash_root = SEED
        """The engine's current weights root (`scheduler.block_hash.weights_root`)."""
        self._root_changed = False

    def set_hash_root(self, root: BlockHash) -> None:
        """The engine's weights changed: later batches carry `root` (one batch at least)."""
        self._root_changed = root != self.hash_root
        self.hash_root = root

    def _all(self) -> tuple[dict[BlockHash, None], ...]:
        return (*self._stored, *self._removed, *self._tier_stored, *self._tier_removed)

    def stored(self, group_id: int, block_hash: BlockHash) -> None:
        """A key became findable."""
        self._removed[group_id].pop(block_hash, None)
        self._stored[group_id][block_hash] = None

    def removed(self, group_id: int, block_hash: BlockHash) -> None:
        """A key stopped being findable (removing a key the replayer lacks is harmless)."""
        self._stored[group_id].pop(block_hash, None)
        self._removed[group_id][block_hash] = None

    def tier_stored(self, group_id: int, block_hash: BlockHash) -> None:
        """A key entered the offload tier."""
        self._tier_removed[group_id].pop(block_hash, None)
        self._tier_stored[group_id][block_hash] = None

    def tier_removed(self, group_id: int, block_hash: BlockHash) -> None:
        """A key left the offload tier."""
        self._tier_stored[group_id].pop(block_hash, None)
        self._tier_removed[group_id][block_hash] = None

    def cleared(self) -> None:
        """Every key was dropped."""
        for keys in self._all():
            keys.clear()
        self._cleared = True

    def take(self) -> KVEventBatch | None:
        """The changes since the last take, or None when there were none."""
        if not self._cleared and not self._root_changed and not any(self._all()):
            return None
        has_tier = any(self._tier_stored) or any(self._tier_removed)
        batch = KVEventBatch(
            stored=tuple(tuple(keys) for keys in self._stored),
            removed=tuple(tuple(keys) for keys in self._removed),
            cleared=self._cleared,
            tier_stored=tuple(tuple(keys) for keys in self._tier_stored) if has_tier else (),
            tier_removed=tuple(tuple(keys) for keys in self._tier_removed) if has_tier else (),
            hash_root=self.hash_root,
        )
        self._root_changed = False
        for keys in self._all():
            keys.clear()
        self._cleared = False
        return batch


OUTLOOK_BLOCKS = 512
"""Free blocks an `EvictionOutlook` covers (what a busy engine may allocate in a poll period)."""


@dataclass(frozen=True)
class EvictionOutlook:
    """The next free blocks one engine's pool would hand out, in its eviction order: per block
    the key (group id, hash) its reuse would evict, or None for a block that holds no key."""

    order: tuple[tuple[int, BlockHash] | None, ...]
    running: tuple[tuple[int, int], ...] = ()
    """Per request running then: its tokens computed and the most it may still generate.
    Decoding, it takes a block in each group from the same queue whenever it crosses a block
    boundary."""


@dataclass(frozen=True)
class KVEventWindow:
    """The latest batches of one engine's event log, as a reader polls them."""

    groups: tuple[KVCacheGroupSpec, ...]
    """The engine's KV cache groups (what a reader needs to predict hits)."""
    first_seq: int
    """Sequence number of `batches[0]` (batches are numbered from 0 without gaps)."""
    batches: tuple[KVEventBatch, ...]
    outlook: EvictionOutlook | None = None
    """The engine's eviction order after the last of `batches` (None: not given)."""
    num_blocks: int = 0
    """The engine's pool size in blocks (0: not given): what a reader weighs its
    conversations' footprint against."""

    @property
    def next_seq(self) -> int:
        """Sequence number the engine's next batch will get."""
        return self.first_seq + len(self.batches)


class KVEventLog:
    """One engine's recent event batches, numbered; bounded by age and by keys held.

    Written by the engine step (a worker thread), read by whoever polls: one lock. The bounds
    are modest because a poller may copy and hash the whole window at every poll (Serve does).
    """

    def __init__(
        self,
        groups: tuple[KVCacheGroupSpec, ...],
        max_keys: int = 1 << 14,
        max_age_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        num_blocks: int = 0,
    ) -> None:
        self.groups = groups
        self.num_blocks = num_blocks
        """The engine's pool size in blocks (0: not given), passed on with each window."""
        self.max_keys = max_keys
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: deque[tuple[float, KVEventBatch]] = deque()
        self._first_seq = 0
        self._num_keys = 0
        self._outlook: EvictionOutlook | None = None
        self._lock = threading.Lock()

    def record(self, batch: KVEventBatch | None, outlook: EvictionOutlook | None = None) -> None:
        """Append a batch (None is ignored) and drop what is too old or too much; keep the
        engine's eviction order as of this step when given."""
        if outlook is not None:
            self._outlook = outlook
        if batch is None:
            return
        with self._lock:
            self._entries.append((self._clock(), batch))
            self._num_keys += batch.num_keys
            self._prune()

    def window(self) -> KVEventWindow:
        """Every batch still held."""
        with self._lock:
            self._prune()
            batches = tuple(batch for _, batch in self._entries)
            return KVEventWindow(
                self.groups, self._first_seq, batches, self._outlook, self.num_blocks
            )

    def _prune(self) -> None:
        oldest = self._clock() - self.max_age_s
        entries = self._entries
        while len(entries) > 1 and (entries[0][0] < oldest or self._num_keys > self.max_keys):
            self._num_keys -= entries.popleft()[1].num_keys
            self._first_seq += 1

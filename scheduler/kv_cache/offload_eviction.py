"""Which entries a level of the offload tier gives up first: vLLM-style LRU, or the ideas of the
device pool's `chain` policy (`scheduler.kv_cache.eviction`) at the tier's scale.

`lru`: one order, least recently stored or touched first. Under cyclic traffic (many sessions
taking turns, more than device and tier hold) it gives up exactly the chain the next turn asks
for, so every turn misses once the working set passes the tier.

`chain`: a request whose prefix hit stopped at a block the tier gave up for room shows that the
tier thrashes on its session; the chain that request frees on the device (its stamp) is then
protected in the tier: its blocks, as the device evicts them, are kept as one chain. Unprotected
entries go first, least recently used first. Among protected chains the most recently protected
goes first (under cyclic reuse it is needed last, so a stable subset stays and hits every turn),
each from its tail (the device evicts chains from their ends, so that is the order they
arrive in), so what is left of it is still a hit. A chain protected before the level stored
`STALE_TURNOVER` times its capacity since is stale (the working set moved on): it goes before
fresh chains, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.eviction import EvictionPolicy

Key = tuple[int, BlockHash]
"""(group id, block hash): the key of a block in every level."""

STALE_TURNOVER = 4
"""A chain protected before its level stored this many times its capacity since is stale
(1, 2, 4 and 8 measured on the 32-session trace; 4 kept: docs/benchmarks.md)."""


MAX_CHAINS = 1 << 16
"""Most protected chains remembered (the oldest is given up first)."""


class _Chain:
    __slots__ = ("keys", "protected_at")

    def __init__(self, protected_at: int) -> None:
        self.keys: dict[Key, None] = {}
        """In the order they arrived: tail first."""
        self.protected_at = protected_at
        """The level's stored bytes when the chain was protected."""


class EntryOrder:
    """The eviction order of one level's keys (membership is the level's)."""

    def __init__(self, policy: EvictionPolicy, capacity_bytes: int) -> None:
        self.policy = policy
        self.capacity_bytes = capacity_bytes
        self.unprotected: OrderedDict[Key, None] = OrderedDict()
        self._chains: OrderedDict[int, _Chain] = OrderedDict()
        """Protected chains by the device stamp of their chain, oldest protection first."""
        self._chain_of: dict[Key, int] = {}
        self.stored_bytes = 0
        """Bytes ever added to the level (the clock of staleness)."""

    def protect(self, stamp: int) -> None:
        """Keep the blocks of the device chain `stamp` as one protected chain (`chain` only)."""
        if self.policy is not EvictionPolicy.CHAIN or stamp < 0 or stamp in self._chains:
            return
        self._chains[stamp] = _Chain(self.stored_bytes)
        if len(self._chains) > MAX_CHAINS:
            _, oldest = self._chains.popitem(last=False)
            for key in oldest.keys:
                del self._chain_of[key]
                self.unprotected[key] = None
                self.unprotected.move_to_end(key, last=False)

    def add(self, key: Key, size: int, oldest: bool = False, stamp: int = -1) -> None:
        """A new key, evicted from device chain `stamp` (-1: none): into that chain when it is
        protected, else most recently used (or, `oldest`, first to go)."""
        self.stored_bytes += size
        if self._join(key, stamp):
            return
        self.unprotected[key] = None
        if oldest:
            self.unprotected.move_to_end(key, last=False)

    def _join(self, key: Key, stamp: int) -> bool:
        chain = self._chains.get(stamp) if stamp >= 0 else None
        if chain is None:
            return False
        chain.keys[key] = None
        self._chain_of[key] = stamp
        return True

    def discard(self, key: Key) -> None:
        if key in self.unprotected:
            del self.unprotected[key]
            return
        stamp = self._chain_of.pop(key)
        chain = self._chains[stamp]
        del chain.keys[key]

    def touch(self, key: Key, stamp: int = -1) -> None:
        """The device pool evicted, from its chain `stamp`, a key the level holds: it joins
        that chain when protected, else is recently used (unless protected)."""
        if stamp >= 0 and stamp in self._chains and self._chain_of.get(key) != stamp:
            self.discard(key)
            self._join(key, stamp)
        elif key in self.unprotected:
            self.unprotected.move_to_end(key)

    def in_eviction_order(self) -> Iterator[Key]:
        """Unprotected keys (least recently used first), stale protected chains (oldest first),
        then the other protected chains (most recently protected first), each tail first."""
        yield from self.unprotected
        stale_before = self.stored_bytes - STALE_TURNOVER * self.capacity_bytes
        num_stale = 0
        for chain in self._chains.values():  # protected oldest first: the stale ones lead
            if chain.protected_at >= stale_before:
                break
            num_stale += 1
            yield from chain.keys
        fresh = islice(reversed(self._chains.values()), len(self._chains) - num_stale)
        for chain in fresh:
            yield from chain.keys

    def victims(
        self, needed: int, block_bytes: Sequence[int], pinned: Mapping[Key, int]
    ) -> list[Key] | None:
        """Keys (not pinned), in eviction order, whose removal frees `needed` bytes; None when
        even all of them would not."""
        out: list[Key] = []
        for key in self.in_eviction_order():
            if needed <= 0:
                break
            if key not in pinned:
                out.append(key)
                needed -= block_bytes[key[0]]
        return out if needed <= 0 else None

"""Eviction policies of the block pool: vLLM's LRU, and `chain`, which keeps whole prefix chains
and resists cyclic traffic (many sessions taking turns in a pool too small for all of them).

`lru`: one free queue; a freed cached block goes to the tail and the front is evicted first.
LRU evicts exactly the chain the next turn of a round-robin will ask for, so once the sessions'
working set exceeds the pool every turn misses (vLLM's sliding-window hit collapse).

`chain` splits the free queue into tiers, evicted in order (each tier front first):

    FRESH      never used, or freed without a hash (nothing to lose)
    TRANSIENT  cached blocks, least recently freed first (what LRU would do)
    PROTECTED  chains kept whole; the most recently freed chain goes first
    HOT        blocks many requests hit and left behind (a shared system prompt's window)

A *chain* is what one finished request frees, all groups together (full-attention blocks and the
window tail or state that makes them a hit point), queued from its last token to its first over
every group, so a chain leaves the cache coherently from its end and its shared trunk goes last.

A chain is protected only when the request extended an earlier chain (its tokens contain the
last block of a chain freed before: a session's next turn) and that earlier chain was protected
or lost blocks to eviction (the cache thrashes on it); other traffic stays in LRU order. It is
protected while PROTECTED fits its budget (the usable pool less HOT and the most blocks requests
have newly allocated at once); past the budget only if its reuse distance (frees since the chain
it extends was freed) is shorter than the recency of the oldest protected chain, which is then
demoted to TRANSIENT (LIRS's rule at chain granularity). Round-robin sessions all have the same
reuse distance, so a stable subset stays protected and hits every turn while the rest cycle
through TRANSIENT; when the working set shifts, old protected chains' recency grows until new
ones displace them. Should requests need more than FRESH and TRANSIENT hold, the most recently
freed protected chain goes first: under cyclic reuse it is the one needed last.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.eviction_history import EvictionHistory
from scheduler.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock


class EvictionPolicy(enum.Enum):
    """How the pool picks which cached block to reuse."""

    LRU = "lru"
    """vLLM's order: least recently freed first (compare traces with vLLM exactly)."""
    CHAIN = "chain"
    """Whole prefix chains, a protected subset under cyclic reuse (default)."""


class Tier(enum.IntEnum):
    """Free-queue tiers of the `chain` policy, evicted in this order."""

    FRESH = 0
    TRANSIENT = 1
    PROTECTED = 2
    HOT = 3


SHARED_FREES = 4
"""A block left behind that hits reused at least this often (once per this many request frees)
is shared by many requests."""

HOT_SHARE = 8
"""The HOT tier (blocks several chains share) holds at most 1/HOT_SHARE of the usable pool; its
oldest blocks overflow into PROTECTED."""

NO_CHAIN = -2
"""`ChainProtection.tier_for`'s "extends no earlier chain"."""


class TieredFreeQueue(FreeBlockQueue):
    """One free queue per `Tier`; pops walk the tiers in order. `num_free_blocks` is the total."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.tiers = [FreeBlockQueue([]) for _ in Tier]
        super().__init__([])
        self.tiers[Tier.FRESH].append_n(blocks)
        self.num_free_blocks = len(blocks)

    def tier_size(self, tier: Tier) -> int:
        return self.tiers[tier].num_free_blocks

    def popleft_n(self, count: int) -> list[KVCacheBlock]:
        """Evict in tier order; PROTECTED gives up its most recently freed chain first, each
        chain from its end."""
        out: list[KVCacheBlock] = []
        for tier, queue in enumerate(self.tiers):
            take = min(count - len(out), queue.num_free_blocks)
            if not take:
                continue
            if tier == Tier.PROTECTED:
                out.extend(self._pop_recent_chains(take))
            else:
                out.extend(queue.popleft_n(take))
            if len(out) == count:
                break
        assert len(out) == count, "free queue exhausted"
        self.num_free_blocks -= count
        return out

    def eviction_order(self, limit: int) -> list[KVCacheBlock]:
        """The first `limit` blocks `popleft_n` would take, in that order (without taking them)."""
        out: list[KVCacheBlock] = []
        for tier, queue in enumerate(self.tiers):
            if len(out) >= limit:
                break
            if tier == Tier.PROTECTED:
                out.extend(self._recent_chains(limit - len(out)))
            else:
                out.extend(queue.eviction_order(limit - len(out)))
        return out

    def _recent_chains(self, limit: int) -> list[KVCacheBlock]:
        """PROTECTED's blocks in `_pop_recent_chains` order: the most recently freed chain
        first, each from its first-queued block."""
        out: list[KVCacheBlock] = []
        last = self.tiers[Tier.PROTECTED].last()
        while last is not None and len(out) < limit:
            chain = [last]
            node = last.prev_free
            while node is not None and node.block_id >= 0 and node.stamp == last.stamp:
                chain.append(node)
                node = node.prev_free
            out.extend(reversed(chain))
            last = node if node is not None and node.block_id >= 0 else None
        return out[:limit]

    def _pop_recent_chains(self, count: int) -> list[KVCacheBlock]:
        queue = self.tiers[Tier.PROTECTED]
        out: list[KVCacheBlock] = []
        while len(out) < count:
            last = queue.last()
            assert last is not None
            chain = [last]
            node = last.prev_free
            while node is not None and node.block_id >= 0 and node.stamp == last.stamp:
                chain.append(node)
                node = node.prev_free
            for block in reversed(chain):  # the chain's first-queued block (its end) first
                if len(out) == count:
                    break
                queue.remove(block)
                out.append(block)
        return out

    def remove(self, block: KVCacheBlock) -> None:
        self.tiers[block.tier].remove(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_to(Tier.TRANSIENT, [block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.append_to(Tier.TRANSIENT, blocks)

    def append_to(self, tier: Tier, blocks: Sequence[KVCacheBlock], stamp: int = -1) -> None:
        """Put blocks at the tail of `tier`, in order, marked with `stamp` when given."""
        self.tiers[tier].append_marked(blocks, tier, stamp)
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            block.tier = Tier.FRESH
        self.tiers[Tier.FRESH].prepend_n(blocks)
        self.num_free_blocks += len(blocks)

    def head(self, tier: Tier) -> KVCacheBlock | None:
        """The next block `tier` would give up, if any."""
        return self.tiers[tier].first()

    def block_ids(self) -> list[int]:
        return [block_id for queue in self.tiers for block_id in queue.block_ids()]


class ChainProtection:
    """The `chain` policy's decision at each request's free: which tier its chain joins."""

    def __init__(self, queue: TieredFreeQueue, num_usable: int, history: EvictionHistory) -> None:
        self.queue = queue
        self.num_usable = num_usable
        self.history = history
        self.peak_in_use = 0
        """Most blocks requests held at once so far, hits taken from the cache excepted: the
        room the protected tier leaves them."""
        self.num_held_hits = 0
        """Blocks requests hold that they took from the cache (a hit), not newly allocated."""
        self.clock = 0
        """Request frees so far (the unit of reuse distance and recency)."""
        self._last_free: OrderedDict[BlockHash, int] = OrderedDict()
        """A freed chain's last block hash -> clock of that free (bounded, oldest dropped)."""

    def note_in_use(self, num_in_use: int) -> None:
        num_allocated = num_in_use - self.num_held_hits
        if num_allocated > self.peak_in_use:
            self.peak_in_use = num_allocated

    def queue_chain(
        self, blocks: list[KVCacheBlock], block_hashes: Sequence[BlockHash], was_protected: bool
    ) -> None:
        """Queue a finished request's newly free cached blocks (its chain, in chain order; its
        tokens hash to `block_hashes`; `was_protected`: some came from a protected chain) in the
        tier `tier_for` picks."""
        self.clock += 1
        extends, thrashed = self._extended_chain(block_hashes)
        tier = self.tier_for(len(blocks), extends, was_protected or thrashed)
        self.queue.append_to(tier, blocks, self.clock)

    def queue_left_behind(self, blocks: list[KVCacheBlock]) -> None:
        """Queue blocks a running request dropped as it advanced (out of its window, an older
        Mamba state). Those hits reuse often (`is_shared`) are a prefix many requests share
        (a system prompt's window): HOT; the others TRANSIENT."""
        shared: list[KVCacheBlock] = []
        others: list[KVCacheBlock] = []
        clock = self.clock
        for block in blocks:  # is_shared, inlined: one pass per freed window
            hits = block.num_hits
            is_shared = hits >= 2 and hits * SHARED_FREES >= clock - block.born + 1
            (shared if is_shared else others).append(block)
        if shared:
            blocks = others
            self.queue.append_to(Tier.HOT, shared, self.clock)
            self._cap_hot()
        self.queue.append_to(Tier.TRANSIENT, blocks, self.clock)

    def is_shared(self, block: KVCacheBlock) -> bool:
        """Hit at least twice, and at least once per `SHARED_FREES` request frees on average
        since it was allocated."""
        hits = block.num_hits
        return hits >= 2 and hits * SHARED_FREES >= self.clock - block.born + 1

    def tier_for(self, num_blocks: int, extends: int, reused: bool) -> Tier:
        """The tier of a chain of `num_blocks` blocks extending the chain freed at `extends`
        (`reused`: that chain was protected or lost blocks to eviction); demotes older
        protected chains when this one displaces them."""
        if extends == NO_CHAIN or not reused:
            return Tier.TRANSIENT
        budget = self.num_usable - self.peak_in_use - self.queue.tier_size(Tier.HOT)
        queue = self.queue
        if queue.tier_size(Tier.PROTECTED) + num_blocks <= budget:
            return Tier.PROTECTED
        if num_blocks > budget:
            return Tier.TRANSIENT
        distance = self.clock - extends
        while queue.tier_size(Tier.PROTECTED) + num_blocks > budget:
            oldest = queue.head(Tier.PROTECTED)
            if oldest is None or self.clock - oldest.stamp <= distance:
                return Tier.TRANSIENT
            self._demote_chain(oldest.stamp)
        return Tier.PROTECTED

    def _cap_hot(self) -> None:
        """Move the oldest HOT blocks to PROTECTED while HOT exceeds its share."""
        queue = self.queue
        excess = queue.tier_size(Tier.HOT) - self.num_usable // HOT_SHARE
        if excess > 0:
            moved = queue.tiers[Tier.HOT].popleft_n(excess)
            queue.num_free_blocks -= excess
            queue.append_to(Tier.PROTECTED, moved)

    def _extended_chain(self, block_hashes: Sequence[BlockHash]) -> tuple[int, bool]:
        """(clock of the free of the longest earlier chain this one extends, or `NO_CHAIN`;
        whether that chain's last block was evicted since). This chain's last hash takes its
        place."""
        last_free = self._last_free
        found: tuple[int, bool] = (NO_CHAIN, False)
        for block_hash in reversed(block_hashes):
            stamp = last_free.pop(block_hash, None)
            if stamp is not None:
                found = (stamp, self.history.was_evicted_anywhere(block_hash))
                break
        if block_hashes:
            last_free[block_hashes[-1]] = self.clock
            if len(last_free) > self.num_usable:
                last_free.popitem(last=False)  # the oldest entry
        return found

    def _demote_chain(self, stamp: int) -> None:
        """Move the protected chain freed at `stamp` (the tier's front) to the transient tail."""
        queue = self.queue
        moved = []
        block = queue.head(Tier.PROTECTED)
        while block is not None and block.stamp == stamp:
            queue.remove(block)
            moved.append(block)
            block = queue.head(Tier.PROTECTED)
        queue.append_to(Tier.TRANSIENT, moved)

"""Eviction policies of the block pool: vLLM's LRU, and `chain`, which keeps whole prefix chains
and resists cyclic traffic (many sessions taking turns in a pool too small for all of them).

`lru`: one free queue; a freed cached block goes to the tail and the front is evicted first.
LRU evicts exactly the chain the next turn of a round-robin will ask for, so once the sessions'
working set exceeds the pool every turn misses (vLLM's sliding-window hit collapse).

`chain` splits the free queue into tiers, evicted in order (each tier front first):

    FRESH      never used, or freed without a hash (nothing to lose)
    STALE      blocks a request dropped as it advanced (out of its window, older Mamba states)
               and that no hit ever used: a later hit point needs them only on divergence
    TRANSIENT  chains not worth protecting now, LRU by chain
    PROTECTED  chains kept whole, LRU by chain

A *chain* is what one finished request frees, all groups together (full-attention blocks and the
window tail that makes them a hit point), ordered from its last token to its first over every
group, so a chain is evicted coherently from its end and a shared trunk goes last. At a request's
free the chain is PROTECTED while the protected tier fits its budget (the usable pool less the
most blocks requests have held at once). Past the budget it is protected only if its reuse
distance (frees since the chain it extends was last freed) is shorter than the recency of the
oldest protected chain, which is then demoted (LIRS's rule, at chain granularity); otherwise it is
TRANSIENT. Round-robin sessions all have the same reuse distance, so a stable subset stays
protected and hits every turn while the rest cycle through the transient tier; a shift of the
working set makes old protected chains' recency grow until new chains displace them.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock


class EvictionPolicy(enum.Enum):
    """How the pool picks which cached block to reuse."""

    LRU = "lru"
    """vLLM's order: least recently freed first (compare traces with vLLM exactly)."""
    CHAIN = "chain"
    """Tiers by value, chains kept whole, protected subset under cyclic traffic (default)."""


class Tier(enum.IntEnum):
    """Free-queue tiers of the `chain` policy, evicted in this order."""

    FRESH = 0
    STALE = 1
    TRANSIENT = 2
    PROTECTED = 3
    HOT = 4


HOT_HITS_PER_FREE = 0.25
"""A block hit at least twice, and on average at least this often per request free since it was
allocated, is HOT: a trunk many chains share (a system prompt, its window tail)."""

HOT_SHARE = 8
"""The HOT tier holds at most 1/HOT_SHARE of the usable pool; its oldest blocks overflow into
TRANSIENT."""


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
        """Evict in tier order; PROTECTED gives up its most recently freed chain first (under
        cyclic reuse that chain is needed last), each chain from its end."""
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

    def append_to(self, tier: Tier, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the tail of `tier`, in order."""
        for block in blocks:
            block.tier = tier
        self.tiers[tier].append_n(blocks)
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
    """The `chain` policy's decisions: which tier a request's freed chain joins, and which of
    its blocks are a shared trunk."""

    def __init__(self, queue: TieredFreeQueue, num_usable: int) -> None:
        self.queue = queue
        self.num_usable = num_usable
        self.peak_in_use = 0
        """Most blocks requests held at once so far: room the protected tier leaves them."""
        self.clock = 0
        """Request frees so far (the unit of reuse distance and recency)."""
        self._last_free: OrderedDict[BlockHash, int] = OrderedDict()
        """A freed chain's last block hash -> clock of that free (bounded, oldest dropped)."""

    def note_in_use(self, num_in_use: int) -> None:
        if num_in_use > self.peak_in_use:
            self.peak_in_use = num_in_use

    def tier_for(self, num_blocks: int, block_hashes: Sequence[BlockHash]) -> tuple[Tier, int]:
        """(tier, clock of the free of the chain it extends, or -2) for a chain of `num_blocks`
        newly free blocks whose tokens hash to `block_hashes`; demotes older protected chains
        when this one displaces them."""
        self.clock += 1
        extends = self._extended_stamp(block_hashes)
        budget = self.num_usable - self.peak_in_use
        queue = self.queue
        if queue.tier_size(Tier.PROTECTED) + num_blocks <= budget:
            return Tier.PROTECTED, extends
        if extends < 0 or num_blocks > budget:
            return Tier.TRANSIENT, extends
        distance = self.clock - extends
        while queue.tier_size(Tier.PROTECTED) + num_blocks > budget:
            oldest = queue.head(Tier.PROTECTED)
            if oldest is None or self.clock - oldest.stamp <= distance:
                return Tier.TRANSIENT, extends
            self._demote_chain(oldest.stamp)
        return Tier.PROTECTED, extends

    def queue_blocks(self, blocks: list[KVCacheBlock], tier: Tier, extends: int | None) -> None:
        """Queue newly free cached blocks: a request's chain (`extends` as `tier_for` gave it)
        or blocks a request left behind as it advanced (`extends` None, `tier` STALE).

        A chain block last freed by another chain is a shared trunk: HOT. A left-behind block
        is HOT when hit often (`is_hot`), TRANSIENT when some hit used it, else STALE.
        """
        clock = self.clock
        if extends is not None:
            hot = [block for block in blocks if block.stamp >= 0 and block.stamp != extends]
            rest = [block for block in blocks if block.stamp < 0 or block.stamp == extends]
            by_tier = {Tier.HOT: hot, tier: rest}
        else:
            by_tier = {Tier.HOT: [], Tier.TRANSIENT: [], tier: []}
            for block in blocks:
                if self.is_hot(block):
                    by_tier[Tier.HOT].append(block)
                else:
                    by_tier[Tier.TRANSIENT if block.num_hits else tier].append(block)
        for block in blocks:
            block.stamp = clock
        for own, members in by_tier.items():
            if members:
                self.queue.append_to(own, members)
        self._cap_hot()

    def is_hot(self, block: KVCacheBlock) -> bool:
        """Hit twice or more, and often for its age (see `HOT_HITS_PER_FREE`)."""
        hits = block.num_hits
        return hits >= 2 and hits >= HOT_HITS_PER_FREE * (self.clock - block.born + 1)

    def _cap_hot(self) -> None:
        """Move the oldest HOT blocks to PROTECTED while HOT exceeds its share."""
        queue = self.queue
        excess = queue.tier_size(Tier.HOT) - self.num_usable // HOT_SHARE
        if excess > 0:
            moved = queue.tiers[Tier.HOT].popleft_n(excess)
            queue.num_free_blocks -= excess
            queue.append_to(Tier.PROTECTED, moved)

    def _extended_stamp(self, block_hashes: Sequence[BlockHash]) -> int:
        """Clock of the free of the longest earlier chain this one extends (-2: none); this
        chain's last hash takes its place."""
        last_free = self._last_free
        stamp = -2
        for block_hash in reversed(block_hashes):
            found = last_free.pop(block_hash, None)
            if found is not None:
                stamp = found
                break
        if block_hashes:
            last_free[block_hashes[-1]] = self.clock
            if len(last_free) > self.num_usable:
                last_free.popitem(last=False)
        return stamp

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

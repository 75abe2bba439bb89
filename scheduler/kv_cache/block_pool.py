"""The shared pool of KV cache blocks: free queue, reference counts and the prefix-cache map.

One `BlockPool` serves every KV cache group; the per-type managers call it. Block 0 is the null
block: a placeholder for "nothing stored here", never handed out, cached or freed.

    free queue:  front [freed unhashed, last freed first | never used | freed hashed, LRU] tail
                 pop from the front, dropping a popped block's hash then (lazy eviction);
                 unhashed freed blocks go to the front (reused first), hashed ones to the tail
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.events import KVEventSink
from scheduler.kv_cache.eviction import ChainProtection, EvictionPolicy, Tier, TieredFreeQueue
from scheduler.kv_cache.eviction_history import EvictionHistory
from scheduler.kv_cache.free_block_queue import FreeBlockQueue, KVCacheBlock
from scheduler.kv_cache.offload import OffloadIndex
from scheduler.kv_cache.offload_levels import DeviceOrOffloaded

__all__ = ["BlockPool", "FreeBlockQueue", "KVCacheBlock"]

logger = logging.getLogger(__name__)


class BlockPool:
    """All blocks of the KV cache, shared by every group; see the module docstring for the policy.

    The prefix-cache map is keyed by (block hash, group id): one dict per group maps a hash to the
    first-registered block still holding it; further blocks with the same key (a block that fills
    while an identical one is cached) wait in `_duplicates` and are promoted on eviction.
    """

    def __init__(
        self, num_blocks: int, num_groups: int, eviction: EvictionPolicy = EvictionPolicy.LRU
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.eviction_history = EvictionHistory(num_blocks)
        """Recently evicted (group, key) pairs, for miss reasons and the `chain` policy."""
        self.chains: ChainProtection | None = None
        """The `chain` policy's state (None: LRU, the queue drawn above)."""
        if eviction is EvictionPolicy.CHAIN:
            tiered = TieredFreeQueue(self.blocks[1:])
            self.free_queue = tiered
            self.chains = ChainProtection(tiered, num_blocks - 1, self.eviction_history)
        self.hash_maps: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        """Per group: hash -> first-registered block holding it (what a lookup returns)."""
        self._duplicates: list[dict[BlockHash, dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]
        """Per group: hash -> the other blocks holding it, by block ID (promotion order)."""
        self._num_used = [0] * num_groups
        self.num_evictions = 0
        """Cached blocks whose hash was dropped to reuse them (cumulative)."""
        self.event_sink: KVEventSink | None = None
        """Told when a key (hash, group) enters or leaves the hash maps (KV events); None: off."""
        self.offload: OffloadIndex | None = None
        """The offload tier below the pool (None: off); see `attach_offload`."""
        self.lookup_maps: Sequence[Mapping[BlockHash, KVCacheBlock]] = self.hash_maps
        """Per group, what prefix lookups read: the hash maps, or device ∪ offload tier."""

    def attach_offload(self, offload: OffloadIndex) -> None:
        """Keep evicted registered blocks in `offload` and let lookups find them there."""
        self.offload = offload
        host, disk = offload.maps
        self.lookup_maps = [
            DeviceOrOffloaded(device, (host[group_id], disk[group_id]))
            for group_id, device in enumerate(self.hash_maps)
        ]

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached-but-evictable included, null block excluded)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks held by requests."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable if usable else 0.0

    def usage_per_group(self) -> tuple[float, ...]:
        """Fraction of the usable blocks each group's requests hold."""
        usable = max(self.num_blocks - 1, 1)
        return tuple(used / usable for used in self._num_used)

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        """The block registered under (hash, group), the first-registered one among duplicates."""
        return self.hash_maps[group_id].get(block_hash)

    def get_new_blocks(self, count: int, group_id: int) -> list[KVCacheBlock]:
        """Pop `count` blocks from the queue front for `group_id`, evicting their old hashes."""
        blocks = self._pop_evicting(count)
        self._hand_out(blocks, group_id)
        self._note_in_use()
        return blocks

    def get_new_blocks_per_group(self, counts: Sequence[int]) -> list[list[KVCacheBlock]]:
        """`get_new_blocks(counts[g], g)` for every group g in turn, as one pop: the same
        blocks, evictions and queue (a request's groups allocate together)."""
        blocks = self._pop_evicting(sum(counts))
        per_group: list[list[KVCacheBlock]] = []
        start = 0
        for group_id, count in enumerate(counts):
            taken = blocks[start : start + count]
            start += count
            if count:
                self._hand_out(taken, group_id)
            per_group.append(taken)
        self._note_in_use()
        return per_group

    def _pop_evicting(self, count: int) -> list[KVCacheBlock]:
        if count > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot take {count} blocks, only {self.num_free_blocks} are free")
        blocks = self.free_queue.popleft_n(count)
        self._evict(blocks)
        return blocks

    def _hand_out(self, blocks: list[KVCacheBlock], group_id: int) -> None:
        """Give popped blocks one reference each in `group_id`, unhashed (their keys left the
        maps as they were popped); under the `chain` policy they start fresh: no tier, stamp nor
        hits until freed again."""
        chains = self.chains
        if chains is None:
            for block in blocks:
                block.ref_cnt = 1
                block.group_id = group_id
                block.block_hash = None
        else:
            born, fresh = chains.clock, Tier.FRESH
            for block in blocks:
                block.ref_cnt = 1
                block.group_id = group_id
                block.block_hash = None
                block.tier = fresh
                block.stamp = -1
                block.num_hits = 0
                block.born = born
        self._num_used[group_id] += len(blocks)

    def _note_in_use(self) -> None:
        if self.chains is not None:
            self.chains.note_in_use(self.num_blocks - 1 - self.free_queue.num_free_blocks)

    def _evict(self, blocks: list[KVCacheBlock]) -> None:
        """Drop the hashes of popped blocks (offering registered ones to the offload tier) and
        record the evictions, in order."""
        evicted = [(b.group_id, b.block_hash) for b in blocks if b.block_hash is not None]
        if not evicted:
            return
        if self.event_sink is None and self.offload is None:
            self._drop_hashes(blocks, evicted)
        else:
            for block in blocks:
                if block.block_hash is not None:
                    self._evict_one(block, block.block_hash)
        self.eviction_history.record_all(evicted)
        self.num_evictions += len(evicted)

    def _drop_hashes(
        self, blocks: list[KVCacheBlock], evicted: list[tuple[int, BlockHash]]
    ) -> None:
        """The map side of `_drop_hash` for every hashed block among `blocks` (`evicted`:
        their keys), without events or an offload tier to tell: a key no duplicate block holds
        is simply deleted. The blocks' own `block_hash` is reset by `_hand_out`."""
        maps, duplicates = self.hash_maps, self._duplicates
        if not any(duplicates):  # every hashed block is the one registered under its key
            for group_id, block_hash in evicted:
                del maps[group_id][block_hash]
            return
        for block in blocks:
            key = block.block_hash
            if key is None:
                continue
            if key in duplicates[block.group_id]:
                self._drop_hash(block)  # a duplicate, or the registered one with duplicates
            else:
                del maps[block.group_id][key]

    def _evict_one(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        offload = self.offload
        if offload is not None and self.hash_maps[block.group_id].get(block_hash) is block:
            stamp = block.stamp if self.chains is not None else -1
            offload.offer(block.group_id, block_hash, block.block_id, stamp)
        self._drop_hash(block)

    def adopt_hit(self, table: list[KVCacheBlock], start: int, req_id: str) -> None:
        """Take a reference on a new table's hit blocks (from `start` on); entries held in the
        offload tier wait for `OffloadIndex.fill`, which swaps in blocks its loads fill."""
        if self.offload is None:
            self.touch(table[start:])
        else:
            self.offload.adopt(self, table, start, req_id)

    def register_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register one held block under `block_hash` in its group (a finished load)."""
        self.cache_full_blocks([block_hash], [block], [0], block.group_id, 1)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit); revive free ones."""
        null = self.null_block
        if self.chains is not None:
            self._touch_tiered(blocks)
            return
        num_revived = 0
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                # Unlink from the free queue (FreeBlockQueue.remove, inlined: hot on long hits).
                prev_node, next_node = block.prev_free, block.next_free
                assert prev_node is not None, f"{block} is not in the queue"
                assert next_node is not None, f"{block} is not in the queue"
                prev_node.next_free = next_node
                next_node.prev_free = prev_node
                block.prev_free = block.next_free = None
                self._num_used[block.group_id] += 1
                num_revived += 1
            block.ref_cnt += 1
        self.free_queue.num_free_blocks -= num_revived

    def _touch_tiered(self, blocks: Iterable[KVCacheBlock]) -> None:
        chains = self.chains
        assert chains is not None
        null = self.null_block
        num_used = self._num_used
        revived_per_tier = [0] * len(Tier)
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                # TieredFreeQueue.remove, inlined (hot on long hits); its tier stays set
                prev_node, next_node = block.prev_free, block.next_free
                assert prev_node is not None, f"{block} is not in the queue"
                assert next_node is not None, f"{block} is not in the queue"
                prev_node.next_free = next_node
                next_node.prev_free = prev_node
                block.prev_free = block.next_free = None
                revived_per_tier[block.tier] += 1
                num_used[block.group_id] += 1
            block.ref_cnt += 1
            block.num_hits += 1
        num_revived = sum(revived_per_tier)
        for queue, num_tier_revived in zip(chains.queue.tiers, revived_per_tier, strict=True):
            queue.num_free_blocks -= num_tier_revived
        chains.queue.num_free_blocks -= num_revived
        chains.num_held_hits += num_revived  # not new allocations

    def free_chain(
        self, ordered_blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Free a finished request's blocks (its chain, `block_hashes` naming its tokens)."""
        self._release((ordered_blocks,), block_hashes)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in order; queue those that reach 0.

        Unhashed ones go to the front (the first given is reused first), hashed ones to the tail
        in the given order, so callers pass a request's blocks tail first. With the `chain`
        policy hashed ones join the transient tier.
        """
        self._release((ordered_blocks,), None)

    def free_blocks_per_group(self, per_group: Sequence[Sequence[KVCacheBlock]]) -> None:
        """`free_blocks` of each list in turn, as one release: the queue ends the same (the
        front gets each list's unhashed blocks in turn, the tail each list's hashed ones)."""
        self._release(per_group, None)

    def _release(
        self,
        lists: Iterable[Iterable[KVCacheBlock]],
        chain_hashes: Sequence[BlockHash] | None,
    ) -> None:
        if self.chains is not None:
            self._release_tiered(lists, chain_hashes)
            return
        null = self.null_block
        to_tail: list[KVCacheBlock] = []
        fronts: list[list[KVCacheBlock]] = []
        num_used = self._num_used
        for ordered_blocks in lists:
            to_front: list[KVCacheBlock] = []
            for block in ordered_blocks:
                if block is null:
                    continue
                block.ref_cnt -= 1
                assert block.ref_cnt >= 0, f"{block} freed more often than taken"
                if block.ref_cnt == 0:
                    num_used[block.group_id] -= 1
                    (to_front if block.block_hash is None else to_tail).append(block)
            if to_front:
                fronts.append(to_front)
        self.free_queue.append_n(to_tail)
        for to_front in fronts:
            self.free_queue.prepend_n(to_front)

    def _release_tiered(
        self,
        lists: Iterable[Iterable[KVCacheBlock]],
        chain_hashes: Sequence[BlockHash] | None,
    ) -> None:
        """`_release` for the `chain` policy: also counts the freed blocks that were hits (their
        tier stays set while held; newly allocated ones are FRESH) and protected ones."""
        chains = self.chains
        assert chains is not None
        null = self.null_block
        to_tail: list[KVCacheBlock] = []
        fronts: list[list[KVCacheBlock]] = []
        num_used = self._num_used
        num_hits = num_protected = 0
        protected = Tier.PROTECTED
        queue_last = to_tail.append
        for ordered_blocks in lists:
            to_front: list[KVCacheBlock] = []
            for block in ordered_blocks:
                if block is null:
                    continue
                ref_cnt = block.ref_cnt - 1
                block.ref_cnt = ref_cnt
                if ref_cnt:
                    assert ref_cnt > 0, f"{block} freed more often than taken"
                    continue
                num_used[block.group_id] -= 1
                tier = block.tier
                if tier:
                    num_hits += 1
                    num_protected += tier == protected
                if block.block_hash is None:
                    to_front.append(block)
                else:
                    queue_last(block)
            if to_front:
                fronts.append(to_front)
        chains.num_held_hits -= num_hits
        if chain_hashes is not None:
            chains.queue_chain(to_tail, chain_hashes, num_protected > 0)
        else:  # one queueing for every list: HOT's cap moves the same blocks as one per list
            chains.queue_left_behind(to_tail)
        for to_front in fronts:
            self.free_queue.prepend_n(to_front)

    def cache_full_blocks(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        block_range: Iterable[int],
        group_id: int,
        hash_ratio: int,
    ) -> None:
        """Register `blocks[i]` for i in `block_range` (null entries skipped).

        Block i of a group whose block size is `hash_ratio` hash blocks is keyed by the chained
        hash of its last hash block, which identifies the whole prefix up to its end.
        """
        hash_map, duplicates = self.hash_maps[group_id], self._duplicates[group_id]
        null = self.null_block
        sink = self.event_sink
        last_of_block = hash_ratio - 1
        for index in block_range:
            block = blocks[index]
            if block is null:
                continue
            assert block.block_hash is None, f"{block} is already registered"
            block_hash = block_hashes[index * hash_ratio + last_of_block]
            block.block_hash = block_hash
            if hash_map.setdefault(block_hash, block) is not block:
                duplicates.setdefault(block_hash, {})[block.block_id] = block
            elif sink is not None:
                sink.stored(group_id, block_hash)

    def demote(self, block_ids: Sequence[int]) -> int:
        """Move the free, registered blocks among `block_ids` to the queue front (evicted
        before any other cached block; the first given first); blocks a request holds stay.
        Returns how many moved."""
        blocks = [self.blocks[block_id] for block_id in block_ids]
        movable = [b for b in blocks if b.ref_cnt == 0 and b.block_hash is not None]
        for block in movable:
            self.free_queue.remove(block)
        self.free_queue.prepend_n(movable)
        return len(movable)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the hashes of these blocks (their contents can no longer be trusted)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._drop_hash(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible while no request holds a block."""
        if self.num_free_blocks != self.num_blocks - 1:
            logger.warning(
                "cannot reset the prefix cache: %d blocks are in use",
                self.num_blocks - 1 - self.num_free_blocks,
            )
            return False
        for hash_map in self.hash_maps:
            hash_map.clear()
        for duplicates in self._duplicates:
            duplicates.clear()
        if self.event_sink is not None:
            self.event_sink.cleared()
        for block in self.blocks:
            block.block_hash = None
        if self.offload is not None:
            self.offload.clear()
        return True

    def _drop_hash(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        hash_map = self.hash_maps[block.group_id]
        duplicates = self._duplicates[block.group_id]
        if hash_map.get(block_hash) is block:
            others = duplicates.get(block_hash)
            if others:
                first_id = next(iter(others))
                hash_map[block_hash] = others.pop(first_id)
                if not others:
                    del duplicates[block_hash]
            else:
                del hash_map[block_hash]
                if self.event_sink is not None:
                    self.event_sink.removed(block.group_id, block_hash)
        else:
            others = duplicates[block_hash]
            del others[block.block_id]
            if not others:
                del duplicates[block_hash]
        block.block_hash = None

    def check_invariants(self) -> None:
        """Assert the pool's internal consistency (tests; O(num_blocks))."""
        queued = self.free_queue.block_ids()
        assert len(queued) == self.num_free_blocks == len(set(queued))
        assert 0 not in queued, "the null block is in the free queue"
        assert self.null_block.block_hash is None
        queued_set = set(queued)
        used = [0] * len(self._num_used)
        for block in self.blocks[1:]:
            assert (block.ref_cnt == 0) == (block.block_id in queued_set), block
            if block.ref_cnt > 0:
                used[block.group_id] += 1
            if block.block_hash is not None:
                registered = self.hash_maps[block.group_id].get(block.block_hash)
                others = self._duplicates[block.group_id].get(block.block_hash, {})
                assert registered is block or others.get(block.block_id) is block, block
        assert used == self._num_used, (used, self._num_used)
        for group_id, hash_map in enumerate(self.hash_maps):
            for block_hash, block in hash_map.items():
                assert block.block_hash == block_hash, block
                assert block.group_id == group_id, block
        for group_id, duplicates in enumerate(self._duplicates):
            for block_hash, others in duplicates.items():
                assert others
                assert block_hash in self.hash_maps[group_id]
                for block in others.values():
                    assert block.block_hash == block_hash, block
                    assert block.group_id == group_id, block

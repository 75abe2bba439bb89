"""A bounded memory of evicted prefix-cache keys, so a later miss can say "evicted".

`BlockPool` records every eviction; `scheduler.kv_cache.miss_reasons` reads it.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler.block_hash import BlockHash


class EvictionHistory:
    """The groups that evicted each of the last `capacity` keys, oldest key forgotten first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(capacity, 1)
        self._groups: OrderedDict[BlockHash, int] = OrderedDict()
        """Key -> bit mask of the groups that evicted it (insertion order: oldest first). An
        OrderedDict: dropping its oldest key is O(1), where a dict's first key is found by
        scanning past the slots of every key deleted before it."""

    def record_all(self, evictions: list[tuple[int, BlockHash]]) -> None:
        """Remember that each (group id, key) was evicted, in order: one call per allocation
        rather than one per evicted block."""
        groups, capacity = self._groups, self.capacity
        get, make_newest, drop_oldest = groups.get, groups.move_to_end, groups.popitem
        newest: BlockHash | None = None
        mask = 0
        for group_id, block_hash in evictions:
            # The groups of one position are often evicted in a row and share one key object;
            # an equal key of another object starts a run that the lookup below merges.
            if block_hash is newest:
                mask |= 1 << group_id
                continue
            if newest is not None:
                groups[newest] = mask
            newest = block_hash
            known = get(block_hash)
            if known is None:
                mask = groups[block_hash] = 1 << group_id
                if len(groups) > capacity:
                    drop_oldest(last=False)
            else:
                mask = known | 1 << group_id
                make_newest(block_hash)
        if newest is not None:
            groups[newest] = mask

    def was_evicted(self, group_id: int, block_hash: BlockHash) -> bool:
        return bool(self._groups.get(block_hash, 0) >> group_id & 1)

    def was_evicted_anywhere(self, block_hash: BlockHash) -> bool:
        return block_hash in self._groups

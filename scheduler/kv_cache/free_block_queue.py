"""Blocks and the free-block queue: an intrusive doubly linked list with O(1) pop, push, unlink.

`BlockPool` owns one `FreeBlockQueue`; the per-type managers hold `KVCacheBlock` references in
their request tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler.block_hash import BlockHash


class KVCacheBlock:
    """One block ID with its bookkeeping; also a node of the free queue."""

    __slots__ = (
        "block_hash",
        "block_id",
        "born",
        "group_id",
        "next_free",
        "num_hits",
        "prev_free",
        "ref_cnt",
        "stamp",
        "tier",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        """Prefix-cache key of the tokens this block holds (None: not registered)."""
        self.group_id = -1
        """KV cache group that last allocated the block (the group part of the cache key)."""
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        # The `chain` eviction policy's bookkeeping (scheduler.kv_cache.eviction).
        self.tier = 0
        """Free-queue tier the block was last queued in."""
        self.stamp = 0
        """Clock of the request free that queued it (its chain's identity and recency)."""
        self.num_hits = 0
        """Prefix hits that reused the block since it was allocated."""
        self.born = 0
        """Request frees counted when the block was allocated."""

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={hashed})"


def block_ids(blocks: Iterable[KVCacheBlock]) -> list[int]:
    """The blocks' IDs, in order (hot for new requests' tables: a comprehension, whose slot
    reads Python 3.11 specializes, takes half the time of `map(attrgetter("block_id"))`)."""
    return [block.block_id for block in blocks]


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with O(1) pop, push and unlink."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft_n(self, count: int) -> list[KVCacheBlock]:
        """Unlink and return the first `count` blocks (the caller checked there are enough)."""
        assert count <= self.num_free_blocks, "free queue exhausted"
        out: list[KVCacheBlock] = []
        append = out.append
        node = self._head.next_free
        for _ in range(count):
            assert node is not None
            append(node)
            following = node.next_free
            node.prev_free = node.next_free = None
            node = following
        assert node is not None
        self._head.next_free = node
        node.prev_free = self._head
        self.num_free_blocks -= count
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue."""
        prev_node, next_node = block.prev_free, block.next_free
        assert prev_node is not None, f"{block} is not in the queue"
        assert next_node is not None, f"{block} is not in the queue"
        prev_node.next_free = next_node
        next_node.prev_free = prev_node
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the tail, in order."""
        self.append_marked(blocks, -1, -1)

    def append_marked(self, blocks: Sequence[KVCacheBlock], tier: int, stamp: int) -> None:
        """`append_n` that also marks the blocks with `tier` (unless -1) and `stamp` (unless -1),
        in the same pass (the `chain` policy's tiers)."""
        if not blocks:
            return
        last = self._tail.prev_free
        assert last is not None
        if stamp >= 0:
            for block in blocks:
                block.tier = tier
                block.stamp = stamp
                last.next_free = block
                block.prev_free = last
                last = block
        elif tier >= 0:
            for block in blocks:
                block.tier = tier
                last.next_free = block
                block.prev_free = last
                last = block
        else:
            for block in blocks:
                last.next_free = block
                block.prev_free = last
                last = block
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the front so that `blocks[0]` is popped first."""
        node = self._head.next_free
        assert node is not None
        for block in reversed(blocks):
            block.next_free = node
            node.prev_free = block
            node = block
        self._head.next_free = node
        node.prev_free = self._head
        self.num_free_blocks += len(blocks)

    def last(self) -> KVCacheBlock | None:
        """The block at the tail, if any."""
        node = self._tail.prev_free
        return None if node is None or node is self._head else node

    def first(self) -> KVCacheBlock | None:
        """The block the next pop returns, if any."""
        node = self._head.next_free
        return None if node is None or node is self._tail else node

    def eviction_order(self, limit: int) -> list[KVCacheBlock]:
        """The first `limit` blocks pops would take, in that order (without taking them)."""
        out: list[KVCacheBlock] = []
        node = self._head.next_free
        while node is not None and node is not self._tail and len(out) < limit:
            out.append(node)
            node = node.next_free
        return out

    def block_ids(self) -> list[int]:
        """Block IDs from front to tail (tests and invariant checks)."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids

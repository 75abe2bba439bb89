"""Block pool: free-queue order, lazy eviction, ref counts, the duplicate-tolerant map (S06)."""

from __future__ import annotations

import pytest

from scheduler.block_hash import hash_block_tokens
from scheduler.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock

H = [hash_block_tokens(None, [index]) for index in range(8)]


def make_pool(num_blocks: int = 11, num_groups: int = 1) -> BlockPool:
    return BlockPool(num_blocks, num_groups)


def cache(pool: BlockPool, block: KVCacheBlock, block_hash: bytes, group_id: int = 0) -> None:
    pool.cache_full_blocks([block_hash], [block], range(1), group_id, 1)


def test_new_pool_has_every_block_but_null_free_in_id_order() -> None:
    pool = make_pool()
    assert pool.num_free_blocks == 10
    assert pool.usage == 0.0
    assert pool.free_queue.block_ids() == list(range(1, 11))
    pool.check_invariants()


def test_free_queue_pop_remove_append_prepend_keep_links() -> None:
    blocks = [KVCacheBlock(block_id) for block_id in range(6)]
    queue = FreeBlockQueue(blocks[1:])
    assert [block.block_id for block in queue.popleft_n(2)] == [1, 2]
    queue.remove(blocks[4])
    queue.append(blocks[1])
    queue.prepend_n([blocks[2], blocks[4]])
    assert queue.block_ids() == [2, 4, 3, 5, 1]
    assert queue.num_free_blocks == 5


def test_get_new_blocks_pops_front_and_evicts_cached_hashes() -> None:
    pool = make_pool()
    (first,) = pool.get_new_blocks(1, 0)
    cache(pool, first, H[0])
    pool.free_blocks([first])
    assert pool.get_cached_block(H[0], 0) is first
    taken = pool.get_new_blocks(10, 0)
    assert [block.block_id for block in taken] == [*range(2, 11), 1]
    assert pool.get_cached_block(H[0], 0) is None
    assert first.block_hash is None
    assert pool.num_evictions == 1
    assert all(block.ref_cnt == 1 for block in taken)
    pool.check_invariants()


def test_get_new_blocks_beyond_free_count_raises_and_changes_nothing() -> None:
    pool = make_pool(4)
    with pytest.raises(ValueError, match="only 3 are free"):
        pool.get_new_blocks(4, 0)
    assert pool.num_free_blocks == 3


def test_free_puts_unhashed_blocks_at_front_first_given_first() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(4, 0)
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids()[:4] == [4, 3, 2, 1]
    assert pool.free_queue.block_ids()[4:] == list(range(5, 11))


def test_free_puts_hashed_blocks_at_tail_in_given_order() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3, 0)
    for block, block_hash in zip(blocks, H, strict=False):
        cache(pool, block, block_hash)
    extra = pool.get_new_blocks(1, 0)
    pool.free_blocks([*extra, *reversed(blocks)])
    assert pool.free_queue.block_ids() == [4, *range(5, 11), 3, 2, 1]


def test_touch_revives_free_block_and_keeps_order_of_the_rest() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(3, 0)
    cache(pool, blocks[1], H[1])
    pool.free_blocks(blocks)
    pool.touch([pool.null_block, blocks[1], blocks[1]])
    assert blocks[1].ref_cnt == 2
    assert 2 not in pool.free_queue.block_ids()
    assert pool.free_queue.block_ids() == [1, 3, *range(4, 11)]
    assert pool.usage_per_group() == (0.1,)
    pool.check_invariants()


def test_duplicate_keys_return_first_registered_and_promote_on_eviction() -> None:
    pool = make_pool()
    first, second, third = pool.get_new_blocks(3, 0)
    for block in (first, second, third):
        cache(pool, block, H[2])
    assert pool.get_cached_block(H[2], 0) is first
    pool.free_blocks([second, first, third])
    pool.check_invariants()
    pool.get_new_blocks(7, 0)  # the never-used blocks 4..10
    assert pool.get_new_blocks(1, 0) == [second]
    assert pool.get_cached_block(H[2], 0) is first
    assert pool.get_new_blocks(1, 0) == [first]
    assert pool.get_cached_block(H[2], 0) is third
    pool.check_invariants()


def test_same_hash_in_two_groups_are_separate_keys() -> None:
    pool = make_pool(num_groups=2)
    block_a = pool.get_new_blocks(1, 0)[0]
    block_b = pool.get_new_blocks(1, 1)[0]
    cache(pool, block_a, H[3], 0)
    cache(pool, block_b, H[3], 1)
    assert pool.get_cached_block(H[3], 0) is block_a
    assert pool.get_cached_block(H[3], 1) is block_b
    assert pool.usage_per_group() == (0.1, 0.1)


def test_evict_blocks_forgets_hash_but_keeps_block_in_use() -> None:
    pool = make_pool()
    (block,) = pool.get_new_blocks(1, 0)
    cache(pool, block, H[4])
    pool.evict_blocks([block.block_id, 5])
    assert block.block_hash is None
    assert pool.get_cached_block(H[4], 0) is None
    assert block.ref_cnt == 1
    pool.check_invariants()


def test_null_block_is_skipped_by_touch_free_and_caching() -> None:
    pool = make_pool()
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    pool.cache_full_blocks([H[0]], [pool.null_block], range(1), 0, 1)
    assert pool.null_block.ref_cnt == 0
    assert pool.null_block.block_hash is None
    assert 0 not in pool.free_queue.block_ids()
    pool.check_invariants()


def test_reset_prefix_cache_only_when_every_block_is_free() -> None:
    pool = make_pool()
    blocks = pool.get_new_blocks(2, 0)
    cache(pool, blocks[0], H[5])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(H[5], 0) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(H[5], 0) is None
    assert all(block.block_hash is None for block in pool.blocks)
    pool.check_invariants()


def test_usage_counts_held_blocks_over_usable_blocks() -> None:
    pool = make_pool()
    pool.get_new_blocks(4, 0)
    assert pool.usage == pytest.approx(0.4)


def test_check_invariants_catches_a_corrupted_ref_count() -> None:
    pool = make_pool()
    (block,) = pool.get_new_blocks(1, 0)
    block.ref_cnt = 0
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_pool_needs_the_null_block() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 1)
    assert BlockPool(1, 1).usage == 0.0

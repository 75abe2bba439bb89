"""Shared manager bookkeeping and the full-attention manager."""

from __future__ import annotations

import pytest
from kv_cache_helpers import find_hit, full, make_request, make_single_manager, register

from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.single_type_manager import NEVER


def test_full_hit_stops_at_first_missing_block() -> None:
    assert find_hit(full(4), "T T F T T") == ([10, 11], 8)
    assert find_hit(full(4), "F T T") == ([], 0)


def test_full_hit_is_capped_by_max_length_and_popped_to_alignment() -> None:
    assert find_hit(full(4), "T T T T", max_length=15) == ([10, 11, 12], 12)
    assert find_hit(full(2), "T T T", alignment=4) == ([10, 11], 4)


def test_groups_of_one_bucket_must_all_hit() -> None:
    pool = BlockPool(100, 2)
    manager = make_single_manager(full(4), pool)
    hashes = make_request("x", list(range(17)), 4).block_hashes
    for index in range(4):
        register(pool, hashes, index, 0, 10 + index)
        if index != 2:
            register(pool, hashes, index, 1, 40 + index)
    found = manager.find_longest_cache_hit(hashes, 16, [0, 1], 4)
    assert [[block.block_id for block in group] for group in found] == [[10, 11], [40, 41]]


def test_coarse_blocks_are_keyed_by_their_last_fine_hash() -> None:
    pool = BlockPool(100, 1)
    manager = make_single_manager(full(8), pool, hash_block_size=4)
    hashes = make_request("x", list(range(24)), 4).block_hashes
    register(pool, hashes, 0, 0, 10, hash_ratio=2)
    register(pool, hashes, 1, 0, 11, hash_ratio=2)
    (found,) = manager.find_longest_cache_hit(hashes, 23, [0], 8)
    assert [block.block_id for block in found] == [10, 11]
    assert [pool.blocks[10].block_hash, pool.blocks[11].block_hash] == [hashes[1], hashes[3]]


def test_block_size_must_be_a_multiple_of_the_hash_block_size() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        make_single_manager(full(6), BlockPool(10, 1), hash_block_size=4)


def test_allocate_cache_and_pop_blocks_track_the_table() -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(full(4), pool)
    hashes = make_request("x", list(range(10)), 4).block_hashes
    manager.allocate_new_computed_blocks("r", [], 0)
    new_blocks = manager.allocate_new_blocks("r", 10)
    assert [block.block_id for block in new_blocks] == [1, 2, 3]
    manager.cache_blocks("r", hashes, 10)
    assert manager.num_cached_block["r"] == 2
    assert pool.get_cached_block(hashes[1], 0) is pool.blocks[2]
    assert manager.quiet_limits("r", True) == (12, NEVER, 12)
    assert [block.block_id for block in manager.pop_blocks("r")] == [3, 2, 1]
    assert "r" not in manager.req_to_blocks


def test_hit_blocks_are_touched_and_count_as_cached() -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(full(4), pool)
    hit_blocks = pool.blocks[5:7]
    assert manager.get_num_blocks_to_allocate("r", 12, hit_blocks, 8) == 3
    manager.allocate_new_computed_blocks("r", hit_blocks, 8)
    assert [block.ref_cnt for block in hit_blocks] == [1, 1]
    assert manager.num_cached_block["r"] == 2
    assert manager.get_num_blocks_to_allocate("r", 12, [], 8) == 1


def test_common_prefix_counts_leading_blocks_held_by_every_running_request() -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(full(4), pool)
    manager.allocate_new_computed_blocks("a", [], 0)
    shared = manager.allocate_new_blocks("a", 8)
    manager.allocate_new_computed_blocks("b", shared[:1], 4)
    manager.allocate_new_blocks("b", 8)
    assert manager.get_num_common_prefix_blocks("a", 2) == 1
    assert manager.get_num_common_prefix_blocks("a", 3) == 0

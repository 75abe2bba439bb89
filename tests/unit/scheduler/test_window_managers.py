"""Sliding-window and chunked-local managers: hit rules (S08-S11), skipped blocks (S21) and the
block-count prediction (S22).

S10's EAGLE variants are adapted, without the drop, with the other EAGLE scenarios.
"""

from __future__ import annotations

import pytest
from kv_cache_helpers import chunked, find_hit, make_single_manager, window

from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.single_type_manager import SingleTypeManager
from scheduler.kv_cache.spec import KVCacheSpec


@pytest.mark.parametrize(
    ("pattern", "expected", "tokens"),
    [
        ("F F F F F F F F F F", [], 0),
        ("T", [10], 2),
        ("T F", [10], 2),
        ("T T", [10, 11], 4),
        ("T T F", [10, 11], 4),
        ("T T T", [0, 11, 12], 6),
        ("T T T F", [0, 11, 12], 6),
        ("T T F T F F T T F T T T", [0] * 10 + [20, 21], 24),
        ("T T F T F F T T F F F", [0] * 6 + [16, 17], 16),
        ("T T F T F F T T F F F T", [0] * 6 + [16, 17], 16),
    ],
)
def test_s08_window_hit_ends_at_first_run_of_two_from_the_right(
    pattern: str, expected: list[int], tokens: int
) -> None:
    assert find_hit(window(2, 4), pattern) == (expected, tokens)


@pytest.mark.parametrize(
    ("spec", "pattern", "tail", "expected", "tokens"),
    [
        (window(4, 8), "T T T F T T", 0, [0, 0, 0, 0, 14, 15], 24),
        (window(4, 8), "T T T F T F", 0, [0, 11, 12], 12),
        (window(4, 8), "F F F F F T", 0, [], 0),
        (window(4, 8), "T F F F F F", 0, [10], 4),
        (window(4, 8), "T T T T T T", -1, [0, 0, 0, 13, 14], 20),
        (window(4, 8), "F T T F T T", 0, [0, 0, 0, 0, 14, 15], 24),
        (window(4, 10), "T T T F T T", 0, [10, 11, 12], 12),
        (window(4, 10), "T T T T T F", 0, [0, 0, 12, 13, 14], 20),
        (window(4, 10), "F F T T T F", 0, [0, 0, 12, 13, 14], 20),
        (window(16, 4), "F F T", 0, [0, 0, 12], 48),
        (window(16, 4), "T F F", 0, [10], 16),
        (window(16, 4), "F T F", 0, [0, 11], 32),
    ],
)
def test_s09_window_geometries(
    spec: KVCacheSpec, pattern: str, tail: int, expected: list[int], tokens: int
) -> None:
    assert find_hit(spec, pattern, tail) == (expected, tokens)


def test_s10_window_hit_cannot_end_at_an_unaligned_block() -> None:
    assert find_hit(window(2, 4), "T T T T T", alignment=4) == ([0, 0, 12, 13], 8)


def test_window_of_one_token_needs_no_cached_block() -> None:
    assert find_hit(window(4, 1), "F F F", tail=1) == ([0, 0, 0], 12)


@pytest.mark.parametrize(
    ("pattern", "tail", "expected", "tokens"),
    [
        ("T", 0, [10], 2),
        ("T", 1, [10], 2),
        ("T F", 0, [0, 0], 4),
        ("T T", 1, [0, 0], 4),
        ("T T F", 0, [0, 0], 4),
        ("T T T", 1, [0, 0, 12], 6),
        ("T T T F", 0, [0, 0, 0, 0], 8),
        ("F F F F F F F F T", 1, [0] * 8 + [18], 18),
        ("T T T T T T T T F", 1, [0] * 8, 16),
        ("F F F F F F F F F F", 0, [0] * 10, 20),
        ("T T T T T T T T T T", 1, [0] * 10, 20),
    ],
)
def test_s11_chunked_local_counts_earlier_chunks_as_hit(
    pattern: str, tail: int, expected: list[int], tokens: int
) -> None:
    assert find_hit(chunked(2, 4), pattern, tail) == (expected, tokens)


@pytest.mark.parametrize(
    ("pattern", "max_length", "expected", "tokens"),
    [
        ("T T T T", 15, [0, 0, 12], 12),
        ("T T F T", 15, [0, 0], 8),
        ("F F F F", 16, [0, 0, 0, 0], 16),
        ("T T T T T", 23, [0, 0, 0, 0, 14], 20),
        ("T T T T F", 23, [0, 0, 0, 0], 16),
    ],
)
def test_s11_chunked_local_block_4_chunk_8(
    pattern: str, max_length: int, expected: list[int], tokens: int
) -> None:
    assert find_hit(chunked(4, 8), pattern, tail=4, max_length=max_length) == (expected, tokens)


def holding(spec: KVCacheSpec, num_blocks: int = 11) -> tuple[SingleTypeManager, BlockPool]:
    """A manager whose request "r" holds blocks 1000..1000+num_blocks-1."""
    pool = BlockPool(1000 + num_blocks, 1)
    manager = make_single_manager(spec, pool)
    pool.get_new_blocks(999, 0)
    manager.allocate_new_computed_blocks("r", [], 0)
    manager.req_to_blocks["r"].extend(pool.get_new_blocks(num_blocks, 0))
    return manager, pool


def table(manager: SingleTypeManager) -> list[int]:
    return [block.block_id for block in manager.req_to_blocks["r"]]


def test_s21_window_frees_only_wholly_skipped_blocks_highest_first() -> None:
    manager, pool = holding(window(2, 4))
    ids = list(range(1000, 1011))
    for computed, expected in [
        (0, ids),
        (4, ids),
        (5, [0, *ids[1:]]),
        (6, [0, *ids[1:]]),
        (7, [0, 0, *ids[2:]]),
    ]:
        manager.remove_skipped_blocks("r", computed)
        assert table(manager) == expected, computed
    manager.remove_skipped_blocks("r", 11)
    assert table(manager) == [0, 0, 0, 0, *ids[4:]]
    # Unhashed blocks go to the queue front; the first freed (highest index) is reused first.
    assert pool.free_queue.block_ids()[:4] == [1003, 1002, 1001, 1000]


def test_s21_chunked_local_frees_blocks_of_finished_chunks() -> None:
    manager, _ = holding(chunked(2, 4))
    ids = list(range(1000, 1011))
    for computed, expected in [
        (0, ids),
        (4, [0, 0, *ids[2:]]),
        (6, [0, 0, *ids[2:]]),
        (12, [0] * 6 + ids[6:]),
    ]:
        manager.remove_skipped_blocks("r", computed)
        assert table(manager) == expected, computed


@pytest.mark.parametrize("spec", [window(2, 4), chunked(2, 4)], ids=["window", "chunked"])
def test_s22_prediction_counts_revived_evictable_hit_blocks(spec: KVCacheSpec) -> None:
    pool = BlockPool(100, 1)
    manager = make_single_manager(spec, pool)
    evictable = pool.blocks[1:11]
    assert manager.get_num_blocks_to_allocate("new", 40, evictable, 0) == 20
    with_nulls = [pool.null_block] * 5 + pool.blocks[1:6]
    assert manager.get_num_blocks_to_allocate("new", 40, with_nulls, 0) == 15


@pytest.mark.parametrize("spec", [window(2, 4), chunked(2, 4)], ids=["window", "chunked"])
def test_s22_small_prediction_matches_what_allocation_takes(spec: KVCacheSpec) -> None:
    pool = BlockPool(100, 1)
    manager = make_single_manager(spec, pool)
    hit_block = pool.blocks[1]
    assert manager.get_num_blocks_to_allocate("r", 4, [hit_block], 2) == 2
    free_before = pool.num_free_blocks
    manager.allocate_new_computed_blocks("r", [hit_block], 2)
    new_blocks = manager.allocate_new_blocks("r", 4)
    assert len(new_blocks) == 1
    assert len(manager.req_to_blocks["r"]) == 2
    assert pool.num_free_blocks == free_before - 2


def test_chunk_size_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ValueError, match="multiple of the block size"):
        make_single_manager(chunked(2, 3), BlockPool(10, 1))

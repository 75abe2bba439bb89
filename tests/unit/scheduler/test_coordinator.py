"""Coordinators: hybrid hits by fixed point (S13, S15-S17, S33, S34), buckets, the junction.

EAGLE variants (S14, the EAGLE row of S33) are adapted, without the drop, with the other EAGLE
scenarios.
"""

from __future__ import annotations

import pytest
from kv_cache_helpers import (
    P3,
    admit,
    chunked,
    full,
    hit,
    make_config,
    make_manager,
    make_request,
    mamba,
    ref_counts,
    register,
    window,
)

from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.coordinator import (
    HybridCoordinator,
    NoPrefixCacheCoordinator,
    UnitaryCoordinator,
    make_coordinator,
)
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import KVCacheSpec


def hybrid_hit(
    specs: list[KVCacheSpec], patterns: list[tuple[str, int]], num_tokens: int, hash_bs: int
) -> tuple[tuple[list[int], ...], int]:
    """Cache block i of group g as ID first_g + i where pattern_g has T; look up a prompt of
    `num_tokens` distinct tokens (candidate num_tokens - 1)."""
    manager = make_manager(200, *specs)
    assert manager.hash_block_size == hash_bs
    hashes = make_request("x", list(range(num_tokens)), hash_bs).block_hashes
    for group_id, (spec, (pattern, first_id)) in enumerate(zip(specs, patterns, strict=True)):
        ratio = spec.block_size // hash_bs
        for index, flag in enumerate(pattern.split()):
            if flag == "T":
                register(manager.pool, hashes, index, group_id, first_id + index, ratio)
    found = manager.coordinator.find_longest_cache_hit(hashes, num_tokens - 1)
    return tuple([b.block_id for b in group] for group in found.blocks), found.num_tokens


def s13_state() -> tuple[KVCacheManager, list[bytes]]:
    """S13 steps 1-3: full + 2 x SW(32), bs 16, pool 21; r0 and r1 allocated then freed."""
    manager = make_manager(21, full(16), window(16, 32), window(16, 32))
    r0 = make_request("r0", P3 + [3] * 7, 16)
    assert admit(manager, r0) == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    r1 = make_request("r1", P3 + [3] * 5, 16)
    assert hit(manager, r1) == (([1, 2, 3], [0, 6, 7], [0, 10, 11]), 48)
    assert admit(manager, r1) == ([13], [14], [15])
    assert ref_counts(manager, [1, 2, 3, 6, 7, 10, 11]) == [2] * 7
    manager.free(r0)
    manager.free(r1)
    return manager, r1.block_hashes


@pytest.mark.parametrize(
    ("removed", "expected", "tokens"),
    [
        ([(0, 1), (0, 2)], ([1, 2, 3], [0, 6, 7], [0, 10, 11]), 48),
        ([(0, 0)], ([], [], []), 0),
        ([(2, 0), (2, 1), (2, 2)], ([1, 2], [5, 6], [9, 10]), 32),
        ([(2, 0)], ([1, 2], [5, 6], [9, 10]), 32),
        ([(2, 1)], ([1, 2], [5, 6], [9, 10]), 32),
        ([(2, 2)], ([1, 2], [5, 6], [9, 10]), 32),
        ([(2, 0), (0, 1), (0, 2)], ([], [], []), 0),
    ],
)
def test_s13_full_and_two_windows_hit_after_removing_keys(
    removed: list[tuple[int, int]], expected: tuple[list[int], ...], tokens: int
) -> None:
    manager, hashes = s13_state()
    for index, group_id in removed:
        block = manager.pool.get_cached_block(hashes[index], group_id)
        assert block is not None
        manager.pool.evict_blocks([block.block_id])
    assert hit(manager, make_request("copy", P3 + [3] * 5, 16)) == (expected, tokens)


def test_s15_different_block_sizes_hit_at_multiples_of_the_lcm() -> None:
    manager = make_manager(100, full(32, dtype_bytes=2), window(16, 32))
    assert (manager.hash_block_size, manager.alignment_tokens) == (16, 32)
    tokens = [value for value in range(10) for _ in range(16)]
    assert admit(manager, make_request("r0", tokens[:112], 16)) == (
        [1, 2, 3, 4],
        [5, 6, 7, 8, 9, 10, 11],
    )
    r1 = make_request("r1", tokens[:113], 16)
    assert hit(manager, r1) == (([1, 2, 3], [0, 0, 0, 0, 9, 10]), 96)
    assert hit(manager, make_request("r2", tokens[:97], 16)) == (
        ([1, 2, 3], [0, 0, 0, 0, 9, 10]),
        96,
    )
    manager.pool.evict_blocks([11, 10])
    assert hit(manager, r1) == (([1, 2], [0, 0, 7, 8]), 64)


S16_SPECS = [full(4), window(4, 8), mamba(4)]


@pytest.mark.parametrize(
    ("sw", "mb", "expected", "tokens"),
    [
        ("T T F T T T", "F T F T F F", ([10, 11], [40, 41], [0, 71]), 8),
        ("T T F T T T", "F F F T F F", ([], [], []), 0),
        (
            "T T T T T T",
            "F F F F F T",
            ([10, 11, 12, 13, 14, 15], [0, 0, 0, 0, 44, 45], [0, 0, 0, 0, 0, 75]),
            24,
        ),
        (
            "F F F F T T",
            "F F F F F T",
            ([10, 11, 12, 13, 14, 15], [0, 0, 0, 0, 44, 45], [0, 0, 0, 0, 0, 75]),
            24,
        ),
        ("F F F F T T", "F F F F T F", ([], [], []), 0),
    ],
)
def test_s16_three_types_reach_a_fixed_point(
    sw: str, mb: str, expected: tuple[list[int], ...], tokens: int
) -> None:
    patterns = [("T T T T T T", 10), (sw, 40), (mb, 70)]
    assert hybrid_hit(S16_SPECS, patterns, 25, 4) == (expected, tokens)


def test_s16_full_miss_bounds_the_other_types() -> None:
    patterns = [("T T T F T T", 10), ("T T T T T T", 40), ("T T T T T T", 70)]
    assert hybrid_hit(S16_SPECS, patterns, 25, 4) == (([10, 11, 12], [0, 41, 42], [0, 0, 72]), 12)


@pytest.mark.parametrize(
    ("specs", "patterns", "expected", "tokens"),
    [
        (
            [window(4, 8), mamba(4)],
            [("T T T T T T", 10), ("T F T F T F", 40)],
            ([0, 0, 0, 13, 14], [0, 0, 0, 0, 44]),
            20,
        ),
        (
            [window(4, 8), window(4, 16)],
            [("T T T T T T", 10), ("T T F T T T", 40)],
            ([10, 11], [40, 41]),
            8,
        ),
        (
            [full(4), full(4), window(4, 8)],
            [("T T T T T T", 10), ("T T F T T T", 40), ("T T T T T T", 70)],
            ([10, 11], [40, 41], [70, 71]),
            8,
        ),
        (
            [full(4), mamba(4)],
            [("T T T T T T", 10), ("T F T F T F", 40)],
            ([10, 11, 12, 13, 14], [0, 0, 0, 0, 44]),
            20,
        ),
    ],
    ids=["window+mamba", "two-windows", "full+full+window", "full+mamba"],
)
def test_s17_hybrids_without_full_or_with_repeated_specs(
    specs: list[KVCacheSpec],
    patterns: list[tuple[str, int]],
    expected: tuple[list[int], ...],
    tokens: int,
) -> None:
    assert hybrid_hit(specs, patterns, 25, 4) == (expected, tokens)


SW = window(16, 32)
SWL = window(16, 64)
MB = mamba(16)
F = full(16)


@pytest.mark.parametrize(
    ("specs", "first", "hit_ids", "new_ids"),
    [
        ([F, SW], [1, 5], ([1, 2, 3], [0, 6, 7]), ([9], [10])),
        ([F, MB], [1, 5], ([1, 2, 3], [0, 0, 7]), ([9], [10])),
        ([SW, MB], [1, 5], ([0, 2, 3], [0, 0, 7]), ([9], [10])),
        ([SW, SWL], [1, 5], ([0, 2, 3], [5, 6, 7]), ([9], [10])),
        ([F, SW, SW], [1, 5, 9], ([1, 2, 3], [0, 6, 7], [0, 10, 11]), ([13], [14], [15])),
        ([F, MB, MB], [1, 5, 9], ([1, 2, 3], [0, 0, 7], [0, 0, 11]), ([13], [14], [15])),
        ([F, SW, MB], [1, 5, 9], ([1, 2, 3], [0, 6, 7], [0, 0, 11]), ([13], [14], [15])),
        ([F, SW, SWL], [1, 5, 9], ([1, 2, 3], [0, 6, 7], [9, 10, 11]), ([13], [14], [15])),
        ([F, F, SW], [1, 5, 9], ([1, 2, 3], [5, 6, 7], [0, 10, 11]), ([13], [14], [15])),
        ([F, F, MB], [1, 5, 9], ([1, 2, 3], [5, 6, 7], [0, 0, 11]), ([13], [14], [15])),
        (
            [F, SW, F, SWL],
            [1, 5, 9, 13],
            ([1, 2, 3], [0, 6, 7], [9, 10, 11], [13, 14, 15]),
            ([17], [18], [19], [20]),
        ),
        (
            [F, MB, F, MB],
            [1, 5, 9, 13],
            ([1, 2, 3], [0, 0, 7], [9, 10, 11], [0, 0, 15]),
            ([17], [18], [19], [20]),
        ),
        (
            [SW, MB, SWL, MB],
            [1, 5, 9, 13],
            ([0, 2, 3], [0, 0, 7], [9, 10, 11], [0, 0, 15]),
            ([17], [18], [19], [20]),
        ),
        (
            [F, F, SW, MB],
            [1, 5, 9, 13],
            ([1, 2, 3], [5, 6, 7], [0, 10, 11], [0, 0, 15]),
            ([17], [18], [19], [20]),
        ),
    ],
)
def test_s33_hybrid_combinations_share_a_48_token_prefix(
    specs: list[KVCacheSpec],
    first: list[int],
    hit_ids: tuple[list[int], ...],
    new_ids: tuple[list[int], ...],
) -> None:
    manager = make_manager(10 * len(specs), *specs)
    r0_blocks = admit(manager, make_request("r0", P3 + [3] * 7, 16))
    assert r0_blocks == tuple(list(range(start, start + 4)) for start in first)
    r1 = make_request("r1", P3 + [4] * 5, 16)
    assert hit(manager, r1) == (hit_ids, 48)
    assert admit(manager, r1) == new_ids
    manager.check_invariants()


def test_s34_every_full_attention_group_is_truncated_to_the_final_hit() -> None:
    specs = [full(16), full(32, dtype_bytes=2), window(16, 32)]
    patterns = [("T T T T T T T T", 10), ("T T T T", 40), ("T T T T", 70)]
    found = hybrid_hit(specs, patterns, 129, 16)
    assert found == (([10, 11, 12, 13], [40, 41], [0, 0, 72, 73]), 64)


def test_junction_reports_the_longer_single_bucket_hit() -> None:
    manager = make_manager(100, full(16), mamba(16))
    hashes = make_request("x", list(range(70)), 16).block_hashes
    register(manager.pool, hashes, 0, 0, 10)
    register(manager.pool, hashes, 1, 0, 11)
    found = manager.coordinator.find_longest_cache_hit(hashes, 69)
    assert (found.num_tokens, found.group_hit_tokens) == (0, (32, 0))
    assert manager.get_computed_blocks(make_request("y", list(range(70)), 16)).junction_tokens == 32


def test_coordinator_kind_follows_caching_and_bucket_count() -> None:
    pool = BlockPool(10, 2)
    two = make_config(10, full(4), window(4, 8)).groups
    assert isinstance(make_coordinator(two, pool, 4, False), NoPrefixCacheCoordinator)
    assert isinstance(make_coordinator((), BlockPool(1, 0), 4, True), NoPrefixCacheCoordinator)
    same = make_config(10, full(4), full(4)).groups
    assert isinstance(make_coordinator(same, pool, 4, True), UnitaryCoordinator)
    assert isinstance(make_coordinator(two, pool, 4, True), HybridCoordinator)


def test_buckets_put_full_attention_first_and_keep_group_order() -> None:
    config = make_config(10, window(4, 8), full(4), mamba(4), full(4))
    coordinator = make_coordinator(config.groups, BlockPool(10, 4), 4, True)
    assert isinstance(coordinator, HybridCoordinator)
    assert [bucket.group_ids for bucket in coordinator.buckets] == [(1, 3), (0,), (2,)]


def test_chunked_local_block_size_must_equal_the_alignment() -> None:
    with pytest.raises(ValueError, match="chunked local"):
        make_manager(10, full(8), chunked(4, 8))
    assert make_manager(10, full(8), chunked(4, 8), enable_caching=False).num_groups == 2

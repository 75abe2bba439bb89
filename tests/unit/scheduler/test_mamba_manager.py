"""Mamba manager: state hits (S12), skipped states (S21) and the three cache modes."""

from __future__ import annotations

import pytest
from kv_cache_helpers import find_hit, make_request, make_single_manager, mamba, register

from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.single_type_manager import SingleTypeManager
from scheduler.kv_cache.spec import MambaCacheMode


@pytest.mark.parametrize(
    ("pattern", "expected", "tokens"),
    [
        ("T F T F", [0, 0, 12], 6),
        ("F F F", [], 0),
        ("T T T T", [0, 0, 0, 13], 8),
        ("T F F T", [0, 0, 0, 13], 8),
    ],
)
def test_s12_last_cached_state_wins(pattern: str, expected: list[int], tokens: int) -> None:
    assert find_hit(mamba(2), pattern) == (expected, tokens)


def test_s12_state_at_unaligned_boundary_is_skipped() -> None:
    assert find_hit(mamba(2), "T T T F T", alignment=4) == ([0, 11], 4)


def test_s12_block_4_limits() -> None:
    assert find_hit(mamba(4), "T F T T", max_length=15) == ([0, 0, 12], 12)
    assert find_hit(mamba(4), "F F F T", max_length=16) == ([0, 0, 0, 13], 16)


def test_none_mode_never_hits() -> None:
    assert find_hit(mamba(2, MambaCacheMode.NONE), "T T T T") == ([], 0)


@pytest.mark.parametrize("mode", [MambaCacheMode.ALL, MambaCacheMode.ALIGN])
def test_s21_only_blocks_before_the_last_computed_token_are_freed(mode: MambaCacheMode) -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(mamba(4, mode), pool)
    manager.allocate_new_computed_blocks("r", [], 0)
    manager.req_to_blocks["r"].extend(pool.get_new_blocks(4, 0))
    manager.remove_skipped_blocks("r", 9)
    assert [block.block_id for block in manager.req_to_blocks["r"]] == [0, 0, 3, 4]
    assert manager.get_num_skipped_tokens(9) == 8


def ids(manager: SingleTypeManager, req_id: str = "r") -> list[int]:
    return [block.block_id for block in manager.req_to_blocks[req_id]]


def test_align_mode_allocates_only_the_running_state_block() -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(mamba(4, MambaCacheMode.ALIGN), pool)
    assert manager.get_num_blocks_to_allocate("r", 8, [], 0) == 1
    manager.allocate_new_computed_blocks("r", [], 0)
    assert [b.block_id for b in manager.allocate_new_blocks("r", 8)] == [0, 1]
    assert ids(manager) == [0, 1]
    assert manager.allocate_new_blocks("r", 8) == []
    assert manager.get_num_blocks_to_allocate("r", 10, [], 8) == 1
    manager.allocate_new_blocks("r", 10)
    assert ids(manager) == [0, 1, 2]
    manager.remove_skipped_blocks("r", 10)
    assert ids(manager) == [0, 0, 2]


def test_align_mode_frees_states_behind_nulls() -> None:
    """A chunk ending at 32 then one ending at 64 leave [-, s32, -, s64]: s32 is freed later."""
    pool = BlockPool(20, 1)
    manager = make_single_manager(mamba(16, MambaCacheMode.ALIGN), pool)
    manager.allocate_new_computed_blocks("r", [], 0)
    manager.allocate_new_blocks("r", 32)
    # The delta a worker appends: the null padding, then the new state block.
    assert [b.block_id for b in manager.allocate_new_blocks("r", 64)] == [0, 2]
    assert ids(manager) == [0, 1, 0, 2]
    manager.remove_skipped_blocks("r", 64)
    assert ids(manager) == [0, 0, 0, 2]
    assert pool.num_free_blocks == 18


def test_align_mode_registers_a_state_only_at_its_block_end() -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(mamba(4, MambaCacheMode.ALIGN), pool)
    hashes = make_request("x", list(range(12)), 4).block_hashes
    manager.allocate_new_computed_blocks("r", [], 0)
    manager.allocate_new_blocks("r", 10)
    manager.cache_blocks("r", hashes, 10)
    assert pool.get_cached_block(hashes[1], 0) is None  # index 1 is null
    assert pool.get_cached_block(hashes[2], 0) is None  # block 1 holds the state at 10
    manager.cache_blocks("r", hashes, 12)
    assert pool.get_cached_block(hashes[2], 0) is pool.blocks[1]


def test_align_mode_registers_a_state_only_where_a_step_ends() -> None:
    """Mamba bs 2 next to a bs-4 group: the tail steps [0, 1) and [1, 3) run past the block end 2,
    so entry 0 keeps the state after one token, not two: it must not be cached (it once was,
    under the hash of the first two tokens). The step [3, 4) ends with entry 1: cached."""
    pool = BlockPool(20, 1)
    manager = make_single_manager(mamba(2, MambaCacheMode.ALIGN), pool)
    hashes = make_request("x", list(range(8)), 2).block_hashes
    manager.allocate_new_computed_blocks("r", [], 0)
    for start, end in ((0, 1), (1, 3), (3, 4)):
        manager.remove_skipped_blocks("r", start)
        manager.allocate_new_blocks("r", end)
        manager.cache_blocks("r", hashes, end)
    assert pool.get_cached_block(hashes[0], 0) is None
    assert pool.get_cached_block(hashes[1], 0) is manager.req_to_blocks["r"][1]


def test_none_mode_keeps_one_state_block_for_life() -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(mamba(4, MambaCacheMode.NONE), pool)
    assert manager.get_num_blocks_to_allocate("r", 100, [], 0) == 1
    manager.allocate_new_computed_blocks("r", [], 0)
    assert len(manager.allocate_new_blocks("r", 100)) == 1
    assert manager.allocate_new_blocks("r", 200) == []
    manager.remove_skipped_blocks("r", 150)
    hashes = make_request("x", list(range(200)), 4).block_hashes
    manager.cache_blocks("r", hashes, 200)
    assert ids(manager) == [1]
    assert manager.quiet_limits("r", True)[0] > 10**9


def test_hit_on_a_coarse_block_uses_the_hash_of_its_last_fine_block() -> None:
    pool = BlockPool(20, 1)
    manager = make_single_manager(mamba(8), pool, hash_block_size=4)
    hashes = make_request("x", list(range(17)), 4).block_hashes
    register(pool, hashes, 1, 0, 7, hash_ratio=2)
    (found,) = manager.find_longest_cache_hit(hashes, 16, [0], 8)
    assert [block.block_id for block in found] == [0, 7]
    assert pool.blocks[7].block_hash == hashes[3]

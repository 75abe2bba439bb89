"""The EAGLE scenarios (S07, S10's EAGLE rows, S14, S33's EAGLE row), adapted.

This cache has no EAGLE drop (speculative decoding is not a feature): with EAGLE, vLLM gives up
the last block of a hit (and a sliding window looks for one block more first) so that the draft
model recomputes it. The scenarios' setups are kept and checked with the plain semantics, which
give one block more than the EAGLE figures wherever the drop would have applied.
"""

from __future__ import annotations

import pytest
from kv_cache_helpers import admit, find_hit, full, hit, make_manager, make_request, window

from scheduler.kv_cache.manager import KVCacheManager

COMMON = [token for index in range(6) for token in [index] * 16]
"""S14's six shared blocks of 16 tokens."""


@pytest.mark.parametrize(
    ("prompt", "num_blocks"),
    [
        ([0] * 16 + [1] * 16 + [2] * 16, 2),  # EAGLE: 1 block (47 -> 2 blocks -> drop 1)
        ([0] * 16 + [1] * 16 + [2] * 5, 2),  # EAGLE: 1
        ([0] * 16 + [1] * 16 + [2] * 16 + [3] * 3, 3),  # EAGLE: 2
    ],
    ids=["48 tokens", "37 tokens", "51 tokens"],
)
def test_s07_primed_prompt_hits_every_whole_block_before_its_last_token(
    prompt: list[int], num_blocks: int
) -> None:
    manager = make_manager(11, full(16))
    first = make_request("primer", prompt, 16)
    admit(manager, first)
    manager.free(first)
    ids, tokens = hit(manager, make_request("again", prompt, 16))
    assert (len(ids[0]), tokens) == (num_blocks, 16 * num_blocks)


def test_s10_window_hit_without_the_extra_block() -> None:
    """bs 2, window 4, all 5 blocks cached: EAGLE needs 3 and drops one ([0,0,12,13], 8)."""
    assert find_hit(window(2, 4), "T T T T T") == ([0, 0, 0, 13, 14], 10)


def test_s10_window_only_model_re_sent_prompt() -> None:
    """bs 16, window 16, 37 tokens primed then re-sent: EAGLE hits 16 tokens, then 0 once
    (h0, g0) is removed; without the drop only the block before the hit end is needed."""
    manager = make_manager(20, window(16, 16))
    prompt = list(range(37))
    primer = make_request("primer", prompt, 16)
    admit(manager, primer)
    manager.free(primer)
    again = make_request("again", prompt, 16)
    assert hit(manager, again) == (([0, 2],), 32)
    block = manager.pool.get_cached_block(again.block_hashes[0], 0)
    assert block is not None
    manager.pool.evict_blocks([block.block_id])
    assert hit(manager, again) == (([0, 2],), 32)


def s14_state() -> tuple[KVCacheManager, list[bytes]]:
    """S14 steps 1-2: full + 2 x SW(48), bs 16, pool 31; r0 and r1 allocated then freed."""
    manager = make_manager(31, full(16), window(16, 48), window(16, 48))
    r0 = make_request("r0", COMMON + [6] * 7, 16)
    assert admit(manager, r0) == tuple(list(range(s, s + 7)) for s in (1, 8, 15))
    r1 = make_request("r1", COMMON + [6] * 5, 16)
    # EAGLE: ([1,2,3,4],[0,9,10,11],[0,16,17,18]), 64, then 37 new tokens in 3 blocks per group.
    expected = ([1, 2, 3, 4, 5, 6], [0, 0, 0, 11, 12, 13], [0, 0, 0, 18, 19, 20])
    assert hit(manager, r1) == (expected, 96)
    assert admit(manager, r1) == ([22], [23], [24])
    manager.free(r0)
    manager.free(r1)
    return manager, r1.block_hashes


@pytest.mark.parametrize(
    ("removed", "num_blocks"),
    [
        ([(0, 1), (0, 2)], 6),  # EAGLE 4: a window never needs block 0 here
        ([(0, 0)], 0),  # EAGLE 0
        ([(5, 0), (5, 1), (5, 2)], 5),  # EAGLE 3
        ([(5, 0)], 5),  # EAGLE 3
        ([(4, 1)], 4),  # EAGLE 3: the window run must end before the hole at block 4
        ([(4, 2)], 4),  # EAGLE 3
        ([(5, 0), (0, 1), (0, 2)], 5),  # EAGLE 0
    ],
)
def test_s14_full_and_two_wide_windows_hit_after_removing_keys(
    removed: list[tuple[int, int]], num_blocks: int
) -> None:
    manager, hashes = s14_state()
    for index, group_id in removed:
        block = manager.pool.get_cached_block(hashes[index], group_id)
        assert block is not None
        manager.pool.evict_blocks([block.block_id])
    ids, tokens = hit(manager, make_request("copy", COMMON + [6] * 5, 16))
    assert tokens == 16 * num_blocks
    assert [len(group) for group in ids] == [num_blocks] * 3


def test_s33_eagle_row_setup_hits_the_four_common_blocks() -> None:
    """full + SW(32), pool 20, 4 common blocks: EAGLE hits 32 tokens ([1,2],[6,7])."""
    manager = make_manager(20, full(16), window(16, 32))
    common = COMMON[:64]
    assert admit(manager, make_request("r0", common + [4] * 7, 16)) == (
        [1, 2, 3, 4, 5],
        [6, 7, 8, 9, 10],
    )
    assert hit(manager, make_request("r1", common + [6] * 5, 16)) == (
        ([1, 2, 3, 4], [0, 0, 8, 9]),
        64,
    )

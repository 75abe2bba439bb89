"""KV cache manager facade, one full-attention group: S02-S06 and the API contract.

ID-exact expectations follow the free-queue policy of our replay semantics, which differs from
vLLM 0.15.1 in one point: blocks freed without a hash (a request's partial last block) go to the
queue front instead of the tail. Where that changes a 0.15.1 number, the test says so.
S07 (EAGLE's dropped last block) is adapted, without the drop, with the other EAGLE scenarios.
"""

from __future__ import annotations

import pytest
from kv_cache_helpers import (
    P3,
    admit,
    decode,
    free_queue,
    full,
    hit,
    make_config,
    make_manager,
    make_request,
    ref_counts,
    step,
    window,
)

from scheduler.kv_cache.manager import KVCacheBlocks, KVCacheManager
from scheduler.request import Request, SamplingParams


def test_s02_allocation_hit_free_and_eviction_order() -> None:
    """0.15.1's queue after step 3 is [6,7,8,9,10,4,5,3,2,1]; with unhashed blocks freed to the
    front it is [5,4,6,...] (the newest vLLM's order), so r2 reuses 5 and r3's list changes."""
    manager = make_manager(11, full(16))
    r0 = make_request("r0", P3 + [3] * 7, 16)
    assert hit(manager, r0) == (([],), 0)
    assert admit(manager, r0) == ([1, 2, 3, 4],)
    assert [manager.pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [True] * 3 + [
        False
    ]
    r1 = make_request("r1", P3 + [3] * 5, 16)
    assert hit(manager, r1) == (([1, 2, 3],), 48)
    assert admit(manager, r1) == ([5],)
    assert ref_counts(manager, [1, 2, 3]) == [2, 2, 2]
    assert manager.num_free_blocks == 5
    manager.free(r0)
    manager.free(r1)
    assert manager.num_free_blocks == 10
    assert free_queue(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    r2 = make_request("r2", P3 + [3] * 6, 16)
    assert hit(manager, r2) == (([1, 2, 3],), 48)
    assert admit(manager, r2) == ([5],)
    assert manager.num_free_blocks == 6
    assert free_queue(manager) == [4, 6, 7, 8, 9, 10]
    manager.free(r2)
    assert free_queue(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    r3 = make_request("r3", [99] * 160, 16)
    assert hit(manager, r3) == (([],), 0)
    assert admit(manager, r3) == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert free_queue(manager) == []
    assert manager.make_stats().num_evictions == 3


def test_s03_eviction_order_across_requests_and_revival_by_touch() -> None:
    """0.15.1: queue [10,6,5,...] and r2 gets [10]; r0's partial block 6 now goes to the front."""
    manager = make_manager(11, full(16))
    tokens = list(range(135))
    r0 = make_request("r0", tokens[:87], 16)
    r1 = make_request("r1", tokens[87:], 16)
    assert admit(manager, r0) == ([1, 2, 3, 4, 5, 6],)
    assert admit(manager, r1) == ([7, 8, 9],)
    assert manager.num_free_blocks == 1
    manager.free(r0)
    manager.free(r1)
    assert free_queue(manager) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    r2 = make_request("r2", tokens[:35], 16)
    assert hit(manager, r2) == (([1, 2],), 32)
    assert admit(manager, r2) == ([6],)
    assert manager.num_free_blocks == 7


def test_s04_exact_multiple_prompt_recomputes_its_last_block_into_a_duplicate() -> None:
    manager = make_manager(11, full(16))
    r0 = make_request("r0", P3, 16)
    assert admit(manager, r0) == ([1, 2, 3],)
    r1 = make_request("r1", P3, 16)
    assert hit(manager, r1) == (([1, 2],), 32)
    assert admit(manager, r1) == ([4],)
    assert manager.pool.blocks[4].block_hash == manager.pool.blocks[3].block_hash
    assert ref_counts(manager, [1, 2, 3, 4]) == [2, 2, 1, 1]
    manager.free(r0)
    manager.free(r1)
    assert free_queue(manager) == [5, 6, 7, 8, 9, 10, 3, 4, 2, 1]
    assert hit(manager, make_request("r2", P3 + [9] * 4, 16)) == (([1, 2, 3],), 48)


def test_s05_failed_allocation_leaves_state_untouched() -> None:
    manager = make_manager(11, full(16))
    assert admit(manager, make_request("r0", P3, 16)) == ([1, 2, 3],)
    r1 = make_request("r1", P3 + P3, 16)
    assert hit(manager, r1) == (([1, 2, 3],), 48)
    assert admit(manager, r1) == ([4, 5, 6],)
    manager.free(r1)
    assert ref_counts(manager, range(1, 7)) == [1, 1, 1, 0, 0, 0]
    assert admit(manager, make_request("r2", [7] * 32, 16)) == ([7, 8],)
    assert manager.num_free_blocks == 5
    r3 = make_request("r3", P3 + P3 + P3, 16)
    assert hit(manager, r3) == (([1, 2, 3, 4, 5, 6],), 96)
    queue_before = free_queue(manager)
    assert admit(manager, r3) is None
    assert ref_counts(manager, range(1, 7)) == [1, 1, 1, 0, 0, 0]
    assert manager.num_free_blocks == 5
    assert free_queue(manager) == queue_before
    assert manager.get_block_ids("r3") == ([],)
    manager.check_invariants()


def test_s06_null_block_usage_and_reset() -> None:
    manager = make_manager(11, full(16))
    assert (manager.num_free_blocks, manager.usage) == (10, 0.0)
    r0 = make_request("r0", [*P3, 1], 16)
    admit(manager, r0)
    assert manager.usage == pytest.approx(0.4)
    assert manager.usage_per_group() == (pytest.approx(0.4),)
    assert manager.reset_prefix_cache() is False
    manager.free(r0)
    assert manager.reset_prefix_cache() is True
    assert hit(manager, make_request("r1", [*P3, 1], 16)) == (([],), 0)
    assert 0 not in free_queue(manager)


def test_hash_block_size_is_gcd_with_caching_and_lcm_without() -> None:
    specs = (full(8), window(4, 8))
    assert make_manager(10, *specs).hash_block_size == 4
    assert make_manager(10, *specs).alignment_tokens == 8
    assert make_manager(10, *specs, enable_caching=False).hash_block_size == 8


def test_caching_off_never_hits_nor_registers() -> None:
    manager = make_manager(11, full(16), enable_caching=False)
    admit(manager, make_request("r0", [*P3, 1], 16))
    found = manager.get_computed_blocks(make_request("r1", [*P3, 1], 16))
    assert (found.num_tokens, found.junction_tokens, found.blocks.is_empty) == (0, 0, True)
    assert all(block.block_hash is None for block in manager.pool.blocks)


def test_model_without_kv_groups_allocates_nothing() -> None:
    manager = KVCacheManager(make_config(1), max_model_len=64)
    request = make_request("r", [1, 2, 3], manager.hash_block_size)
    assert manager.get_computed_blocks(request).num_tokens == 0
    new_blocks = manager.allocate_slots(request, 3)
    assert new_blocks is not None
    assert new_blocks.get_block_ids() == ()
    assert manager.get_num_common_prefix_blocks("r", 1) == ()
    manager.free(request)


def test_decode_between_block_boundaries_allocates_nothing() -> None:
    manager = make_manager(11, full(4))
    request = make_request("r", [1, 2, 3, 4, 5], 4)
    assert admit(manager, request) == ([1, 2],)
    assert decode(manager, request, 6) == ([],)
    assert decode(manager, request, 7) == ([],)
    assert manager.pool.blocks[2].block_hash is None
    assert decode(manager, request, 8) == ([],)
    assert manager.pool.get_cached_block(request.block_hashes[1], 0) is manager.pool.blocks[2]
    assert decode(manager, request, 9) == ([3],)


def test_lookahead_slots_are_allocated_but_never_registered() -> None:
    manager = make_manager(11, full(4))
    request = make_request("r", [1, 2, 3, 4, 5, 6], 4)
    new_blocks = manager.allocate_slots(request, 6, num_lookahead_tokens=4)
    assert new_blocks is not None
    assert new_blocks.get_block_ids() == ([1, 2, 3],)
    assert [manager.pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [
        True,
        False,
        False,
    ]


def test_slots_are_capped_at_max_model_len() -> None:
    manager = make_manager(50, full(4), max_model_len=10)
    request = make_request("r", list(range(8)), 4)
    new_blocks = manager.allocate_slots(request, 8, num_lookahead_tokens=20)
    assert new_blocks is not None
    assert new_blocks.get_block_ids() == ([1, 2, 3],)


def test_running_request_cannot_take_new_hits() -> None:
    manager = make_manager(11, full(4))
    request = make_request("r", [1, 2, 3, 4, 5], 4)
    admit(manager, request)
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.allocate_slots(request, 1, 4)


def test_request_hashed_at_another_granularity_is_rejected() -> None:
    manager = make_manager(11, full(16))
    with pytest.raises(ValueError, match="hashes blocks of 8"):
        manager.get_computed_blocks(make_request("r", P3, 8))


def test_preempted_request_frees_everything_and_hits_its_own_blocks_again() -> None:
    manager = make_manager(20, full(4))
    request = make_request("r", list(range(10)), 4)
    admit(manager, request)
    decode(manager, request, 99)
    manager.free(request)
    assert manager.num_free_blocks == 19
    request.num_computed_tokens = 0
    assert hit(manager, request) == (([1, 2],), 8)
    manager.free(request)  # freeing a request that holds nothing is a no-op
    manager.check_invariants()


def test_stats_are_cumulative_per_group_counters() -> None:
    manager = make_manager(11, full(16))
    admit(manager, make_request("r0", [*P3, 3], 16))
    admit(manager, make_request("r1", [*P3, 4], 16))
    stats = manager.make_stats()
    assert (stats.num_queries, stats.query_tokens, stats.group_hit_tokens) == (2, (98,), (48,))
    assert stats.hit_tokens == 48
    assert stats.usage == pytest.approx(0.5)
    assert manager.make_stats() == stats
    # A lookup counts only once its request is admitted (a waiting request is looked up again
    # every step); a request that reads no hit is no lookup at all.
    manager.get_computed_blocks(make_request("waiting", [*P3, 5], 16))
    scored = Request("scored", [*P3, 6], SamplingParams(prompt_logprobs=1), 16)
    manager.record_lookup(scored, manager.get_computed_blocks(scored))
    assert manager.make_stats() == stats


def test_kv_cache_blocks_ids_and_empty() -> None:
    blocks = KVCacheBlocks.empty(2)
    assert blocks.get_block_ids() == ([], [])
    assert blocks.is_empty


def test_quiet_path_matches_the_full_path() -> None:
    """A decode loop gives identical tables, queues and hashes with the fast path off."""

    class SlowManager(KVCacheManager):
        _use_quiet_path = False

    results = []
    for cls in (KVCacheManager, SlowManager):
        manager = cls(make_config(30, full(4), window(4, 6)), max_model_len=100)
        request = make_request("r", list(range(7)), 4)
        admit(manager, request, 3)
        step(manager, request, 4)
        tables = [decode(manager, request, 100 + index) for index in range(13)]
        results.append((tables, manager.get_block_ids("r"), free_queue(manager)))
    assert results[0] == results[1]


def test_prompt_logprobs_request_reads_no_hit_but_registers_its_blocks() -> None:
    """Scoring every prompt token needs every token computed: no cache read, but writes stay."""
    manager = make_manager(11, full(16))
    r0 = make_request("r0", P3 + [3] * 7, 16)
    admit(manager, r0)
    scored = Request("scored", P3 + [3] * 5, SamplingParams(prompt_logprobs=1), 16)
    assert hit(manager, scored) == (([],), 0)
    assert admit(manager, scored) == ([5, 6, 7, 8],)
    manager.free(r0)
    manager.free(scored)
    again = make_request("again", P3 + [3] * 5, 16)
    assert hit(manager, again)[1] == 48

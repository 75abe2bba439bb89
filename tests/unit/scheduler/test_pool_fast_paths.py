"""The block pool's fast paths end exactly where its general ones do (blocks, evictions, queue
order, tiers, counters): a request's groups allocate and drop out-of-window blocks in one pool
call rather than one per group in turn, and popped blocks' keys are deleted directly unless a
duplicate block holds the same key (or KV events or an offload tier must be told)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kv_cache_helpers import make_manager, make_request, window

from scheduler.block_hash import hash_block_tokens
from scheduler.kv_cache.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_cache.events import KVEventSink
from scheduler.kv_cache.eviction import EvictionPolicy, TieredFreeQueue

NUM_GROUPS = 3
KEYS = [hash_block_tokens(None, [index]) for index in range(12)]
"""Few keys, so that some blocks register a key another block holds (duplicates)."""


def _snapshot(pool: BlockPool) -> dict[str, Any]:
    """Everything the pool's policy can read later."""
    queue = pool.free_queue
    tiers = queue.tiers if isinstance(queue, TieredFreeQueue) else [queue]
    chains = pool.chains
    return {
        "queues": [tier.block_ids() for tier in tiers],
        "blocks": [
            (b.ref_cnt, b.group_id, b.block_hash, b.tier, b.stamp, b.num_hits, b.born)
            for b in pool.blocks
        ],
        "maps": [sorted((k, b.block_id) for k, b in m.items()) for m in pool.hash_maps],
        "history": list(pool.eviction_history._groups.items()),
        "counters": (pool.num_evictions, pool.usage_per_group(), pool.num_free_blocks),
        "chains": None if chains is None else (chains.peak_in_use, chains.num_held_hits),
    }


def _hold(pool: BlockPool, rng: random.Random, held: list[list[KVCacheBlock]]) -> None:
    """Take a few blocks for one group, registering most of them."""
    group_id, count = rng.randrange(NUM_GROUPS), rng.randint(1, 3)
    if count > pool.num_free_blocks:
        return
    blocks = pool.get_new_blocks(count, group_id)
    for block in blocks:
        if rng.random() < 0.7:
            pool.cache_full_blocks([rng.choice(KEYS)], [block], range(1), group_id, 1)
    held.append(blocks)


def _release(pool: BlockPool, rng: random.Random, held: list[list[KVCacheBlock]]) -> None:
    """Free one held list, sometimes after hits on it (so that some blocks run HOT)."""
    blocks = held.pop(rng.randrange(len(held)))
    num_hits = rng.choice([0, 0, 2, 3])
    for _ in range(num_hits):
        pool.touch(blocks)
    for _ in range(num_hits + 1):
        if rng.random() < 0.3:
            pool.free_chain(blocks[::-1], [KEYS[0]])
        else:
            pool.free_blocks(blocks[::-1])


def _busy_pool(policy: EvictionPolicy, seed: int) -> tuple[BlockPool, list[list[KVCacheBlock]]]:
    """A pool of 40 blocks after random takes, registrations, hits and frees (every tier in
    use under `chain`); the lists still held are returned."""
    pool = BlockPool(41, NUM_GROUPS, policy)
    rng = random.Random(seed)
    held: list[list[KVCacheBlock]] = []
    for _ in range(120):
        _hold(pool, rng, held)
        if held and rng.random() < 0.55:
            _release(pool, rng, held)
    return pool, held


POLICIES = [EvictionPolicy.LRU, EvictionPolicy.CHAIN]


def _assert_same_end(fast: BlockPool, general: BlockPool) -> None:
    """The two pools (same start, one through a fast path) end alike, and consistent."""
    assert _snapshot(fast) == _snapshot(general)
    fast.check_invariants()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", POLICIES)
def test_one_pop_for_every_group_takes_what_a_pop_per_group_takes(
    policy: EvictionPolicy, seed: int
) -> None:
    batched, _ = _busy_pool(policy, seed)
    one_by_one, _ = _busy_pool(policy, seed)
    first = min(3, batched.num_free_blocks)
    counts = [first, 0, min(2, batched.num_free_blocks - first)]  # a group taking none, too
    per_group = batched.get_new_blocks_per_group(counts)
    expected = [one_by_one.get_new_blocks(count, group) for group, count in enumerate(counts)]
    assert [[b.block_id for b in blocks] for blocks in per_group] == [
        [b.block_id for b in blocks] for blocks in expected
    ]
    _assert_same_end(batched, one_by_one)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", POLICIES)
def test_one_release_for_every_group_queues_what_a_release_per_group_queues(
    policy: EvictionPolicy, seed: int
) -> None:
    batched, held = _busy_pool(policy, seed)
    one_by_one, twin_held = _busy_pool(policy, seed)
    assert len(held) >= NUM_GROUPS, "the scenario holds too few lists"
    batched.free_blocks_per_group([blocks[::-1] for blocks in held])
    for blocks in twin_held:
        one_by_one.free_blocks(blocks[::-1])
    _assert_same_end(batched, one_by_one)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", POLICIES)
def test_popped_keys_leave_the_maps_as_one_by_one_drops_with_events_leave_them(
    policy: EvictionPolicy, seed: int
) -> None:
    """Every free block is popped, duplicates among them (promoted or dropped) included."""
    direct, _ = _busy_pool(policy, seed)
    told, _ = _busy_pool(policy, seed)
    told.event_sink = KVEventSink(NUM_GROUPS)  # each key's drop must be told: one by one
    assert any(direct._duplicates), "the scenario registers no duplicate key"
    direct.get_new_blocks(direct.num_free_blocks, 0)
    told.get_new_blocks(told.num_free_blocks, 0)
    _assert_same_end(direct, told)


def test_window_groups_drop_and_grow_together_through_the_coordinator() -> None:
    """Two window groups of one request: their out-of-window blocks leave in one release, and
    their new blocks come from one pop, group after group."""
    manager = make_manager(40, window(4, 8), window(4, 8), eviction=EvictionPolicy.CHAIN)
    request = make_request("r", list(range(24)), 4)
    blocks = manager.allocate_slots(request, 24)
    assert blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12])
    request.num_computed_tokens = 24
    request.append_output_token_ids([5])
    grown = manager.allocate_slots(request, 1)
    assert grown is not None
    assert grown.get_block_ids() == ([13], [14])
    # Tokens 0-16 left both windows: each group's blocks 0-3, highest first, group 0 first.
    transient = manager.pool.free_queue.tiers[1].block_ids()  # type: ignore[attr-defined]
    assert transient == [4, 3, 2, 1, 10, 9, 8, 7]
    manager.check_invariants()

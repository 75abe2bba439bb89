"""The offload tier's eviction order: LRU, and the `chain` policy's ideas (the chains of sessions
the tier thrashes on are protected, the most recently protected out first, each from its tail;
stale ones first), then its effect on cyclic sessions replayed with a tier."""

from __future__ import annotations

import random
from typing import Any

from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.offload_eviction import STALE_TURNOVER, EntryOrder, Key
from scheduler.replay import TraceReplayer, build_manager


def _key(index: int) -> Key:
    return (0, index.to_bytes(4, "big"))


def _order(policy: EvictionPolicy, capacity: int = 100) -> EntryOrder:
    return EntryOrder(policy, capacity)


def _indices(order: EntryOrder) -> list[int]:
    return [int.from_bytes(key[1], "big") for key in order.in_eviction_order()]


def test_lru_ignores_protection_and_gives_up_the_least_recently_used_first() -> None:
    order = _order(EvictionPolicy.LRU)
    order.protect(5)
    for index in range(4):
        order.add(_key(index), 1, stamp=5)
    order.touch(_key(1))
    assert _indices(order) == [0, 2, 3, 1]


def test_protected_chains_go_last_most_recent_first_each_from_its_tail() -> None:
    """The device evicts a chain tail first (that is the order its blocks arrive in)."""
    order = _order(EvictionPolicy.CHAIN)
    order.protect(1)
    order.protect(2)
    order.add(_key(0), 1)
    order.add(_key(12), 1, stamp=1)  # chain 1's tail first
    order.add(_key(11), 1, stamp=1)
    order.add(_key(22), 1, stamp=2)
    order.add(_key(21), 1, stamp=2)
    order.add(_key(5), 1, stamp=3)  # a chain not protected
    assert _indices(order) == [0, 5, 22, 21, 12, 11]


def test_a_chain_protected_before_the_level_turned_over_goes_first() -> None:
    order = _order(EvictionPolicy.CHAIN, capacity=1)
    order.protect(1)
    order.add(_key(11), 1, stamp=1)
    for index in range(STALE_TURNOVER + 1):  # more than the capacity times the turnover
        order.add(_key(index), 1)
    order.protect(2)
    order.add(_key(21), 1, stamp=2)
    assert _indices(order)[-2:] == [11, 21]  # the stale chain before the fresh one


def test_a_held_key_evicted_again_joins_the_protected_chain_it_came_from() -> None:
    """A tier hit's blocks go back to the device and are evicted again with the request's new
    blocks: the whole chain is kept."""
    order = _order(EvictionPolicy.CHAIN)
    order.add(_key(1), 1)
    order.add(_key(2), 1)
    order.protect(7)
    order.add(_key(3), 1, stamp=7)
    order.touch(_key(1), stamp=7)
    assert _indices(order) == [2, 3, 1]


def test_the_tier_protects_the_chain_of_a_request_whose_hit_it_cut_short() -> None:
    """A session's next turn misses blocks the tier gave up for room: the chain that turn frees
    is protected in the tier."""
    trace = _trace("chain", num_blocks=6, tier_blocks=2)
    manager = build_manager(trace)
    replayer = TraceReplayer(manager)
    sessions = [[100 * s + i for i in range(48)] for s in range(3)]
    for session, tokens in enumerate(sessions):  # 2 cached blocks each: the tier overflows
        replayer.run(_turn(f"a{session}", tokens))
    tier = manager.pool.offload
    assert tier is not None
    assert not tier.host.order._chains
    replayer.run(_turn("b0", sessions[0] + [7] * 16))
    assert tier.host.order._chains, "a thrashing session's chain is protected"


def _trace(eviction: str, num_blocks: int, tier_blocks: int) -> dict[str, Any]:
    return {
        "groups": [{"type": "full", "block_size": 16}],
        "num_blocks": num_blocks,
        "max_model_len": 2048,
        "kv_offloading_blocks": tier_blocks,
        "kv_offloading_eviction": eviction,
    }


def _turn(req_id: str, tokens: list[int]) -> list[dict[str, Any]]:
    return [{"op": "prefill", "id": req_id, "tokens": tokens}, {"op": "free", "id": req_id}]


def _cyclic_sessions(eviction: str) -> int:
    """Hit tokens of 12 chat sessions taking 6 turns in a pool of about 3 and a tier of 3."""
    rng = random.Random(0)
    histories = [[rng.randrange(1000) for _ in range(64)] for _ in range(12)]
    ops: list[dict[str, Any]] = []
    for turn in range(6):
        for session, history in enumerate(histories):
            history.extend(rng.randrange(1000, 10**6) for _ in range(48))
            req_id = f"s{session}t{turn}"
            ops.append({"op": "prefill", "id": req_id, "tokens": list(history)})
            ops.append({"op": "free", "id": req_id})
    records = TraceReplayer(build_manager(_trace(eviction, 3 * 24, 3 * 24))).run(ops)
    return sum(record["hit_tokens"] for record in records if record["op"] == "prefill")


def test_chain_eviction_keeps_more_of_cyclic_sessions_than_lru() -> None:
    lru, chain = _cyclic_sessions("lru"), _cyclic_sessions("chain")
    assert chain > 1.2 * lru

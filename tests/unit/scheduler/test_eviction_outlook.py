"""The cache index anticipates the evictions an engine makes for requests routed to it before
their events arrive: on hand traces its prediction is the hit the engine then gives."""

from __future__ import annotations

import pytest
from kv_cache_helpers import full, make_config, mamba, window
from scheduler_drive import make_request, make_scheduler, run_step
from scheduler_fake_runner import FakeModelRunner

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.cache_index import CacheIndex
from scheduler.kv_cache.events import KVEventLog
from scheduler.kv_cache.eviction import EvictionPolicy, Tier
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheSpec, MambaCacheMode
from scheduler.scheduler import Scheduler

MODELS: dict[str, tuple[int, tuple[KVCacheSpec, ...]]] = {
    "full": (8, (full(4),)),
    "full+sliding": (14, (full(4), window(4, 5))),
    "full+mamba-align": (14, (full(4), mamba(4, MambaCacheMode.ALIGN))),
}
"""Model -> (pool blocks, specs): after two 3-block sessions, room for one more but not two."""


def serve(
    scheduler: Scheduler, runner: FakeModelRunner, log: KVEventLog, req_id: str, prompt: list[int]
) -> None:
    scheduler.add_request(make_request(scheduler, req_id, prompt, max_tokens=1))
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
        manager = scheduler.kv_cache_manager
        log.record(manager.take_events(), manager.eviction_outlook(scheduler.running))


def engine_hit(scheduler: Scheduler, prompt: list[int]) -> int:
    probe = make_request(scheduler, "probe", prompt)
    return scheduler.kv_cache_manager.get_computed_blocks(probe).num_tokens


@pytest.mark.parametrize("policy", list(EvictionPolicy))
@pytest.mark.parametrize("model", list(MODELS))
def test_routed_prompts_evict_in_the_index_what_they_evict_in_the_engine(
    model: str, policy: EvictionPolicy
) -> None:
    num_blocks, specs = MODELS[model]
    config = make_config(num_blocks, *specs)
    scheduler = make_scheduler(config, max_model_len=64, prefix_cache_eviction=policy)
    scheduler.kv_cache_manager.enable_events()
    runner = FakeModelRunner(config)
    log = KVEventLog(config.groups, max_keys=1 << 20, max_age_s=1e9)
    index = CacheIndex(config.groups)
    first, second, third = list(range(1, 13)), list(range(21, 33)), list(range(41, 53))
    serve(scheduler, runner, log, "first", first)
    serve(scheduler, runner, log, "second", second)
    index.replay(log.window())
    turns = [[*first, 99, 98, 97, 96], [*second, 99, 98, 97, 96]]
    before = [index.predict_hit(index.block_hashes(t), len(t), now=0.0) for t in turns]
    assert before == [engine_hit(scheduler, t) for t in turns] == [12, 12]

    # The third session is routed; the engine serves it before its events reach the index.
    index.guess_stored(index.block_hashes(third), len(third), now=0.0)
    predicted = [index.predict_hit(index.block_hashes(t), len(t), now=0.0) for t in turns]
    serve(scheduler, runner, log, "third", third)
    actual = [engine_hit(scheduler, t) for t in turns]
    assert predicted == actual
    assert actual != before, "the third session evicted nothing: the trace proves nothing"

    index.replay(log.window())  # the events agree
    assert [index.predict_hit(index.block_hashes(t), len(t), now=0.0) for t in turns] == actual


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_the_outlook_lists_blocks_in_the_order_the_pool_evicts_them(policy: EvictionPolicy) -> None:
    config = make_config(40, full(4), window(4, 8))
    scheduler = make_scheduler(config, max_model_len=128, prefix_cache_eviction=policy)
    scheduler.kv_cache_manager.enable_events()
    runner = FakeModelRunner(config)
    log = KVEventLog(config.groups, max_keys=1 << 20, max_age_s=1e9)
    sessions = [list(range(100 * s + 1, 100 * s + 14)) for s in range(5)]
    for turn in range(4):  # sessions taking turns in a pool too small for all: chains protected
        for number, history in enumerate(sessions):
            history.extend(range(50 + turn * 7, 57 + turn * 7))
            serve(scheduler, runner, log, f"s{number}-{turn}", list(history))
    pool = scheduler.kv_cache_manager.pool
    if pool.chains is not None:
        assert pool.free_queue.tier_size(Tier.PROTECTED) > 0, "no chain protected"
    num_free = pool.num_free_blocks
    order = [block.block_id for block in pool.free_queue.eviction_order(num_free)]
    assert order == [block.block_id for block in pool.get_new_blocks(num_free, 0)]


GUESS_MODELS: dict[str, tuple[KVCacheSpec, ...]] = {
    "full+sliding": (full(4), window(4, 5)),
    "full+mamba-align": (full(4), mamba(4, MambaCacheMode.ALIGN)),
}


def engine_with_index(
    config: KVCacheConfig,
) -> tuple[Scheduler, FakeModelRunner, KVEventLog, CacheIndex]:
    """A scheduler publishing KV events, its fake runner, the event log and an empty index."""
    scheduler = make_scheduler(config, max_model_len=128)
    scheduler.kv_cache_manager.enable_events()
    log = KVEventLog(config.groups, max_keys=1 << 20, max_age_s=1e9)
    return scheduler, FakeModelRunner(config), log, CacheIndex(config.groups)


def engine_keys(scheduler: Scheduler) -> list[set[BlockHash]]:
    return [set(hash_map) for hash_map in scheduler.kv_cache_manager.pool.hash_maps]


def index_keys(index: CacheIndex) -> list[set[BlockHash]]:
    return [set(hash_map) for hash_map in index._pool.hash_maps]


@pytest.mark.parametrize("model", list(GUESS_MODELS))
def test_the_index_guesses_the_keys_a_routed_prompt_makes_the_engine_store(model: str) -> None:
    """For each prompt routed, the index's keys right after the guess are the engine's keys
    after serving it: a new prompt sharing only a system prompt (in ALIGN mode the engine stops
    a chunk at that junction and keeps its state), one whose length is a multiple of the block
    size (no state at its last block), a next turn after the engine dropped window blocks the
    hit no longer reads (not computed again, so not stored again); and the events agree."""
    config = make_config(200, *GUESS_MODELS[model])
    scheduler, runner, log, index = engine_with_index(config)
    system = list(range(1, 11))
    first = [*system, *range(100, 114)]
    second = [*system, *range(200, 218)]  # 28 tokens: 7 whole blocks
    turns = [first, second, [*first, *range(300, 307)]]
    for number, prompt in enumerate(turns):
        if number == 2:  # the engine dropped the first turn's early window blocks
            evict_early_window_blocks(scheduler, index.block_hashes(first)[:3])
            manager = scheduler.kv_cache_manager
            log.record(manager.take_events(), manager.eviction_outlook(scheduler.running))
            index.replay(log.window())
        index.guess_stored(index.block_hashes(prompt), len(prompt), now=0.0)
        guessed = index_keys(index)
        serve(scheduler, runner, log, f"r{number}", prompt)
        assert guessed == engine_keys(scheduler), number
        index.replay(log.window())
        assert index_keys(index) == engine_keys(scheduler), number


def evict_early_window_blocks(scheduler: Scheduler, block_hashes: list[BlockHash]) -> None:
    """Evict the keys of these blocks in every group but the first (full attention)."""
    pool = scheduler.kv_cache_manager.pool
    for manager in scheduler.kv_cache_manager.coordinator.managers[1:]:
        hash_map = pool.hash_maps[manager.group_id]
        blocks = [hash_map.get(block_hash) for block_hash in block_hashes]
        pool.evict_blocks(block.block_id for block in blocks if block is not None)


def test_guesses_a_prompt_did_not_store_go_once_its_prefill_is_seen_done() -> None:
    """Two new conversations share a system prompt and are routed before either runs: the index
    expects the second to stop a chunk at the shared prefix (its junction with the first's
    guessed blocks) and keep the Mamba state there. The engine runs the second first, so it has
    no such junction and keeps no such state; once its events show its prefill done, the index
    drops that guess and predicts, like the engine, no hit for a third prompt on the system
    prompt."""
    config = make_config(200, full(4), mamba(4, MambaCacheMode.ALIGN))
    scheduler, runner, log, index = engine_with_index(config)
    system = list(range(1, 9))
    first, second, third = ([*system, *range(base, base + 9)] for base in (100, 200, 300))
    for prompt in (first, second):
        index.guess_stored(index.block_hashes(prompt), len(prompt), now=0.0)
    serve(scheduler, runner, log, "second", second)
    index.replay(log.window())
    third_hashes = index.block_hashes(third)
    assert engine_hit(scheduler, third) == 0
    assert index.predict_hit(third_hashes, len(third), now=0.0) == 0


@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_the_index_anticipates_the_blocks_running_requests_decode_into(
    policy: EvictionPolicy,
) -> None:
    """A request decodes while two sessions' chains wait in the free queue, nothing else free:
    over the next six steps it crosses one block boundary, so it evicts one block (not the 1.5
    an average rate of one block per block size of tokens gives), and the index, six steps
    behind, predicts the hits the engine then gives."""
    config = make_config(10, full(4))
    scheduler = make_scheduler(config, max_model_len=64, prefix_cache_eviction=policy)
    scheduler.kv_cache_manager.enable_events()
    runner = FakeModelRunner(config)
    log = KVEventLog(config.groups, max_keys=1 << 20, max_age_s=1e9)
    index = CacheIndex(config.groups, steps_ahead=6)
    first, second = list(range(1, 13)), list(range(21, 33))
    serve(scheduler, runner, log, "first", first)
    serve(scheduler, runner, log, "second", second)
    decoding = make_request(scheduler, "decoding", list(range(61, 67)), max_tokens=30)
    scheduler.add_request(decoding)
    while decoding.num_computed_tokens < 9:
        step_and_record(scheduler, runner, log)
    assert scheduler.kv_cache_manager.pool.num_free_blocks == 6
    index.replay(log.window())
    turns = [[*first, 99, 98, 97, 96], [*second, 99, 98, 97, 96]]
    predicted = [index.predict_hit(index.block_hashes(t), len(t), now=0.0) for t in turns]
    for _ in range(6):
        step_and_record(scheduler, runner, log)
    actual = [engine_hit(scheduler, t) for t in turns]
    assert predicted == actual
    assert sorted(actual) == [8, 12], "not one block evicted: the trace proves nothing"


def step_and_record(scheduler: Scheduler, runner: FakeModelRunner, log: KVEventLog) -> None:
    run_step(scheduler, runner)
    manager = scheduler.kv_cache_manager
    log.record(manager.take_events(), manager.eviction_outlook(scheduler.running))

"""The cache index anticipates the evictions an engine makes for requests routed to it before
their events arrive: on hand traces its prediction is the hit the engine then gives."""

from __future__ import annotations

import pytest
from kv_cache_helpers import full, make_config, window
from scheduler_drive import make_request, make_scheduler, run_step
from scheduler_fake_runner import FakeModelRunner

from scheduler.kv_cache.cache_index import CacheIndex
from scheduler.kv_cache.events import KVEventLog
from scheduler.kv_cache.eviction import EvictionPolicy, Tier
from scheduler.kv_cache.spec import KVCacheSpec
from scheduler.scheduler import Scheduler

MODELS: dict[str, tuple[int, tuple[KVCacheSpec, ...]]] = {
    "full": (8, (full(4),)),
    "full+sliding": (14, (full(4), window(4, 5))),
}
"""Model -> (pool blocks, specs): after two 3-block sessions, room for one more but not two."""


def serve(
    scheduler: Scheduler, runner: FakeModelRunner, log: KVEventLog, req_id: str, prompt: list[int]
) -> None:
    scheduler.add_request(make_request(scheduler, req_id, prompt, max_tokens=1))
    while scheduler.has_unfinished_requests():
        run_step(scheduler, runner)
        manager = scheduler.kv_cache_manager
        log.record(manager.take_events(), manager.eviction_outlook(len(scheduler.running)))


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

"""KV events and the cache index: replaying an engine's events gives exactly its prefix-cache keys,
and the index predicts exactly the hit the engine finds, for hybrid models under eviction."""

from __future__ import annotations

import random

import pytest
from kv_cache_helpers import full, make_config, mamba, window
from scheduler_drive import make_request, make_scheduler, run_step
from scheduler_fake_runner import FakeModelRunner

from scheduler.kv_cache.cache_index import CacheIndex
from scheduler.kv_cache.events import KVEventBatch, KVEventLog, KVEventSink
from scheduler.kv_cache.spec import KVCacheSpec, MambaCacheMode
from scheduler.scheduler import Scheduler

MODELS = {
    "full+sliding": (full(4), window(4, 8)),
    "full+mamba-align": (full(4), mamba(4, MambaCacheMode.ALIGN)),
    "full+sliding+mamba-all": (full(4), window(8, 12), mamba(8)),
}


def index_keys(index: CacheIndex) -> list[set[bytes]]:
    return [set(hash_map) for hash_map in index._pool.hash_maps]


def engine_keys(scheduler: Scheduler) -> list[set[bytes]]:
    return [set(hash_map) for hash_map in scheduler.kv_cache_manager.pool.hash_maps]


def chat_prompts(rng: random.Random, num_sessions: int, num_turns: int) -> list[list[int]]:
    """Growing conversations: each turn extends its session's previous prompt."""
    sessions = [
        [rng.randrange(1, 90) for _ in range(rng.randrange(6, 20))] for _ in range(num_sessions)
    ]
    prompts = []
    for _ in range(num_turns):
        for history in sessions:
            history.extend(rng.randrange(1, 90) for _ in range(rng.randrange(3, 12)))
            prompts.append(list(history))
    return prompts


@pytest.mark.parametrize("name", list(MODELS))
def test_replayed_events_mirror_the_cache_and_predict_its_hits(name: str) -> None:
    specs: tuple[KVCacheSpec, ...] = MODELS[name]
    config = make_config(96, *specs)
    scheduler = make_scheduler(config, max_model_len=256, max_num_batched_tokens=24)
    scheduler.kv_cache_manager.enable_events()
    runner = FakeModelRunner(config)
    log = KVEventLog(config.groups, max_keys=1 << 20, max_age_s=1e9)
    index = CacheIndex(config.groups)
    rng = random.Random(7)
    prompts = chat_prompts(rng, num_sessions=4, num_turns=5)
    num_checked = num_nonzero = 0
    for number, prompt in enumerate(prompts):
        probe = make_request(scheduler, f"probe{number}", prompt)
        predicted = index.predict_hit(index.block_hashes(prompt), len(prompt), now=0.0)
        actual = scheduler.kv_cache_manager.get_computed_blocks(probe).num_tokens
        assert predicted == actual, (number, predicted, actual)
        num_checked += 1
        num_nonzero += actual > 0
        scheduler.add_request(make_request(scheduler, f"r{number}", prompt, max_tokens=6))
        while scheduler.has_unfinished_requests():
            run_step(scheduler, runner)
            log.record(scheduler.kv_cache_manager.take_events())
            if rng.random() < 0.5:  # a reader polls now and then, seeing several batches at once
                index.replay(log.window())
        index.replay(log.window())
        assert index_keys(index) == engine_keys(scheduler)
    assert scheduler.kv_cache_manager.pool.num_evictions > 0, "the pool never evicted"
    assert num_nonzero > num_checked // 4, "too few hits to mean anything"


def test_reset_and_a_missed_window_rebuild_the_index() -> None:
    config = make_config(32, full(4), window(4, 8))
    scheduler = make_scheduler(config, max_model_len=128)
    scheduler.kv_cache_manager.enable_events()
    runner = FakeModelRunner(config)
    clock = [0.0]
    log = KVEventLog(config.groups, max_keys=1 << 20, max_age_s=5.0, clock=lambda: clock[0])
    index = CacheIndex(config.groups)
    for number in range(3):
        scheduler.add_request(make_request(scheduler, f"a{number}", list(range(1 + number, 30))))
        while scheduler.has_unfinished_requests():
            run_step(scheduler, runner)
            log.record(scheduler.kv_cache_manager.take_events())
            clock[0] += 1.0
    index.replay(log.window())  # the first batches aged out unseen: a gap
    assert index.next_seq == log.window().next_seq
    assert all(
        keys <= engine
        for keys, engine in zip(index_keys(index), engine_keys(scheduler), strict=True)
    )
    assert scheduler.reset_prefix_cache()
    log.record(scheduler.kv_cache_manager.take_events())
    index.replay(log.window())
    assert index_keys(index) == [set(), set()]


def test_guesses_expire_unless_events_confirm_them() -> None:
    config = make_config(32, full(4), window(4, 8))
    index = CacheIndex(config.groups, guess_ttl=10.0)
    prompt = list(range(1, 26))
    hashes = index.block_hashes(prompt)
    index.guess_stored(hashes, len(prompt), now=0.0)
    assert index.predict_hit(hashes, len(prompt) + 1, now=1.0) == 24
    index.apply(KVEventBatch(stored=((hashes[0],), ()), removed=((), ())))
    # Only full attention's block 0 is confirmed: the window group has nothing, so no hit.
    assert index.predict_hit(hashes, len(prompt) + 1, now=11.0) == 0
    assert index.num_keys == 1
    index.apply(KVEventBatch(stored=((), (hashes[0],)), removed=((), ())))
    assert index.predict_hit(hashes, len(prompt) + 1, now=11.0) == 4


def test_sink_keeps_the_net_change() -> None:
    sink = KVEventSink(1)
    sink.stored(0, b"a")
    sink.removed(0, b"a")
    sink.stored(0, b"b")
    batch = sink.take()
    assert batch == KVEventBatch(stored=((b"b",),), removed=((b"a",),))
    assert sink.take() is None
    sink.stored(0, b"c")
    sink.cleared()
    sink.stored(0, b"d")
    assert sink.take() == KVEventBatch(stored=((b"d",),), removed=((),), cleared=True)

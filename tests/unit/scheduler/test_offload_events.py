"""KV events of the offload tier: a router's index replaying them predicts the hit the engine
finds over its device pool and tier together, and the device hit alone."""

from __future__ import annotations

import random

from kv_cache_helpers import full, make_config, window
from scheduler_drive import make_request, make_scheduler, run_step
from scheduler_fake_runner import FakeModelRunner
from test_kv_events import chat_prompts

from scheduler.config import OffloadConfig
from scheduler.kv_cache.cache_index import CacheIndex
from scheduler.kv_cache.events import KVEventLog
from scheduler.kv_cache.offload import OffloadedBlock


def test_tier_events_predict_the_engine_hit_over_device_and_tier() -> None:
    config = make_config(40, full(4), window(4, 8))
    scheduler = make_scheduler(
        config, max_model_len=256, max_num_batched_tokens=24, kv_offloading=OffloadConfig(400)
    )
    manager = scheduler.kv_cache_manager
    manager.enable_events()
    runner = FakeModelRunner(config)
    log = KVEventLog(config.groups, max_keys=1 << 20, max_age_s=1e9)
    index = CacheIndex(config.groups)
    num_tier_hits = 0
    for number, prompt in enumerate(chat_prompts(random.Random(3), num_sessions=4, num_turns=5)):
        probe = make_request(scheduler, f"probe{number}", prompt)
        hit = manager.get_computed_blocks(probe)
        hashes = index.block_hashes(prompt)
        device = index.predict_hit(hashes, len(prompt), now=0.0)
        tiered = index.predict_tier_hit(hashes, len(prompt))
        has_tier_blocks = any(isinstance(b, OffloadedBlock) for g in hit.blocks.blocks for b in g)
        assert (tiered if has_tier_blocks else device) == hit.num_tokens, number
        num_tier_hits += has_tier_blocks and tiered > device
        scheduler.add_request(make_request(scheduler, f"r{number}", prompt, max_tokens=6))
        while scheduler.has_unfinished_requests():
            run_step(scheduler, runner)
            log.record(manager.take_events())
        index.replay(log.window())
    assert num_tier_hits > 0

"""A drafter's layers (draft model, MTP) in the KV cache planner and manager: groups of their
own, never shared with the target's layers, and k lookahead slots in those groups only."""

from __future__ import annotations

from dataclasses import replace

from kv_cache_helpers import full, make_config, mamba

from scheduler.config import SchedulerConfig
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.output import ModelRunnerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.spec_config import SpecMethod, SpeculativeConfig


def test_drafter_layers_get_groups_of_their_own() -> None:
    target, drafter = full(4), replace(full(4), drafter=True)
    specs = {"l0": target, "l1": target, "drafter.l0": drafter, "drafter.l1": drafter}
    config = build_kv_cache_config(specs, 1 << 20, max_model_len=64)
    for group in config.groups:
        is_drafter = {name.startswith("drafter.") for name in group.layer_names}
        assert is_drafter == {group.spec.drafter}, group  # no group mixes the two
    assert [group.spec.drafter for group in config.groups] == [False, True]


def test_lookahead_slots_only_in_drafter_groups_and_all_freed() -> None:
    k, prompt = 3, list(range(6))
    speculative = SpeculativeConfig(SpecMethod.DRAFT_MODEL, k, model="draft")
    settings = SchedulerConfig(speculative=speculative)
    specs = (full(4), replace(full(4), drafter=True), mamba(4))
    scheduler = Scheduler(settings, make_config(64, *specs))
    request = Request("a", prompt, SamplingParams(max_tokens=1), scheduler.hash_block_size)
    scheduler.add_request(request)
    out = scheduler.schedule()
    target_blocks, drafter_blocks, _ = out.scheduled_new_reqs[0].block_ids
    assert len(target_blocks) == 2  # 6 tokens
    assert len(drafter_blocks) == 3  # 6 tokens + 3 drafts' KV from the last known token
    result = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]])
    scheduler.update_from_output(out, result)
    assert "a" not in scheduler.requests
    assert scheduler.kv_cache_manager.usage == 0

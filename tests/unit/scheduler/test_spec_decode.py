"""The scheduler's side of speculative decoding, with exact outcomes: drafts scheduled after
the last token, rejected ones rolled back, nothing cached past the accepted point, k state slots
per drafting request in recurrent groups (and the restore copy), the block-end rule and the
batch-size switch."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kv_cache_helpers import chunked, full, make_config, mamba, window

from scheduler.config import SchedulerConfig
from scheduler.kv_cache.spec import KVCacheSpec, MambaCacheMode
from scheduler.output import BlockCopy, ModelRunnerOutput, SchedulerOutput, StateSave
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.spec_config import SpecMethod, SpeculativeConfig
from scheduler.step_plan import StepPlan


def _scheduler(
    *specs: KVCacheSpec, k: int = 3, num_blocks: int = 64, **config: object
) -> Scheduler:
    extra: dict = config.pop("spec", {})  # type: ignore[assignment]
    method = extra.pop("method", SpecMethod.NGRAM)
    speculative = SpeculativeConfig(method, k, **extra) if k else None
    settings = SchedulerConfig(speculative=speculative, **config)  # type: ignore[arg-type]
    return Scheduler(settings, make_config(num_blocks, *specs))


def _add(scheduler: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 32) -> Request:
    request = Request(
        req_id,
        prompt,
        SamplingParams(temperature=0, max_tokens=max_tokens),
        scheduler.hash_block_size,
    )
    scheduler.add_request(request)
    return request


def _step(
    scheduler: Scheduler, sampled: dict[str, list[int]], drafts: dict[str, list[int]]
) -> SchedulerOutput:
    out = scheduler.schedule()
    _finish(scheduler, out, sampled, drafts)
    return out


def test_drafts_are_verified_and_rejected_ones_rolled_back() -> None:
    scheduler = _scheduler(full(4))
    request = _add(scheduler, "a", list(range(6)))
    _step(scheduler, {"a": [100]}, {"a": [1, 2, 3]})
    out = _step(scheduler, {"a": [1, 50]}, {"a": [7, 8, 9]})  # d1 accepted, then 50
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_tokens == {"a": [1, 2, 3]}
    assert request.output_token_ids == [100, 1, 50]
    assert request.num_computed_tokens == 8  # the prompt, 100 and the accepted draft
    assert request.spec_token_ids == [7, 8, 9]
    stats = scheduler.make_stats().spec_decoding
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.num_accepted_tokens_per_pos == (1, 0, 0)
    scheduler.kv_cache_manager.check_invariants()


def test_no_block_past_the_accepted_point_is_cached() -> None:
    scheduler = _scheduler(full(4), k=4)
    _add(scheduler, "a", [5, 6, 7])
    _step(scheduler, {"a": [8]}, {"a": [1, 2, 3, 4]})  # 4 tokens known: one full block
    out = _step(scheduler, {"a": [9]}, {})  # drafts fill block 1: all rejected
    assert out.scheduled_spec_tokens == {"a": [1, 2, 3, 4]}
    pool = scheduler.kv_cache_manager.pool
    assert len(pool.hash_maps[0]) == 1  # block 0 only: block 1 held drafts
    _step(scheduler, {"a": [10]}, {})
    assert len(pool.hash_maps[0]) == 1  # 6 tokens known: still one full block


@pytest.mark.parametrize("mode", [MambaCacheMode.ALIGN, MambaCacheMode.ALL, MambaCacheMode.NONE])
def test_recurrent_groups_hold_k_states_per_drafting_request(mode: MambaCacheMode) -> None:
    """Memory arithmetic: speculation costs exactly k state blocks per drafting request per
    recurrent group, beyond what the tables hold without it."""
    used = {}
    for k in (0, 3):
        scheduler = _scheduler(full(4), mamba(4, mode), k=k, num_blocks=64)
        for req_id in ("a", "b"):
            _add(scheduler, req_id, list(range(9)))
        _step(scheduler, {"a": [100], "b": [101]}, {"a": [1, 2], "b": [3]})
        _step(scheduler, {"a": [1, 60], "b": [3, 61]}, {})  # every draft accepted
        used[k] = (
            scheduler.kv_cache_manager.pool.num_blocks - scheduler.kv_cache_manager.num_free_blocks
        )
        scheduler.kv_cache_manager.check_invariants()
    assert used[3] - used[0] == 2 * 3


@pytest.mark.parametrize("mode", [MambaCacheMode.ALIGN, MambaCacheMode.ALL, MambaCacheMode.NONE])
def test_a_recurrent_drafter_costs_its_states_per_running_request(mode: MambaCacheMode) -> None:
    """Memory arithmetic with a draft model whose layer keeps a recurrent state: beyond the
    target alone it costs, per running request, its own table states (as many as the target's
    recurrent group holds, no lookahead slot) and per drafting request k draft-position states
    in each recurrent group (the target's and the drafter's)."""
    k, used = 3, {}
    state_blocks = 0
    for with_drafter in (False, True):
        drafter = (replace(mamba(4, mode), drafter=True),) if with_drafter else ()
        spec = {"method": SpecMethod.DRAFT_MODEL, "model": "draft"}
        scheduler = _scheduler(full(4), mamba(4, mode), *drafter, k=k, num_blocks=64, spec=spec)
        for req_id in ("a", "b"):
            _add(scheduler, req_id, list(range(9)))
        _step(scheduler, {"a": [100], "b": [101]}, {"a": [1, 2], "b": [3]})
        _step(scheduler, {"a": [1, 60], "b": [3, 61]}, {})  # every draft accepted
        manager = scheduler.kv_cache_manager
        used[with_drafter] = manager.pool.num_blocks - manager.num_free_blocks
        managers = manager.coordinator.managers
        state_blocks = sum(
            block is not manager.pool.null_block
            for req_id in ("a", "b")
            for block in managers[1].req_to_blocks[req_id]
        )
        if with_drafter:
            drafter_tables = [managers[2].req_to_blocks[req_id] for req_id in ("a", "b")]
            assert [len(table) for table in drafter_tables] == [
                len(managers[1].req_to_blocks[req_id]) for req_id in ("a", "b")
            ]  # no lookahead slot in the drafter's state group
        manager.check_invariants()
    assert used[True] - used[False] == state_blocks + 2 * k


def test_rejection_restores_the_accepted_state_before_the_next_step() -> None:
    scheduler = _scheduler(full(4), mamba(16, MambaCacheMode.NONE), k=3)
    request = _add(scheduler, "a", list(range(5)))
    _step(scheduler, {"a": [100]}, {"a": [1, 2, 3]})
    out = _step(scheduler, {"a": [1, 70]}, {})  # one of three accepted
    assert request.num_computed_tokens == 7
    slots = scheduler.kv_cache_manager.spec_slots
    assert slots is not None
    (slot_blocks,) = slots._slots["a"]
    group = 1
    assert list(out.state_saves) == [
        StateSave("a", 6 + j, group, slot_blocks[j].block_id) for j in range(3)
    ]
    following = scheduler.schedule()
    (state_block,) = scheduler.kv_cache_manager.get_block_ids("a")[group]
    assert following.copies_before_step == (BlockCopy(group, slot_blocks[1].block_id, state_block),)


def test_verify_steps_stop_short_of_a_recurrent_block_end() -> None:
    """Block size 8: from 13 computed tokens a verify step may compute 2 (13, 14); token 15,
    the block's last, is computed by a plain step so its state lands as without drafts."""
    scheduler = _scheduler(full(8), mamba(8, MambaCacheMode.ALL), k=4)
    _add(scheduler, "a", list(range(13)))
    _step(scheduler, {"a": [100]}, {"a": [1, 2, 3, 4]})
    out = _step(scheduler, {"a": [1, 9]}, {"a": [5, 6]})
    assert out.scheduled_spec_tokens == {"a": [1]}
    out = _step(scheduler, {"a": [11]}, {"a": [5]})  # computed 15: the block's last token
    assert out.scheduled_spec_tokens == {}


def test_disable_by_batch_size_turns_drafts_off_under_load() -> None:
    scheduler = _scheduler(full(4), k=2, spec={"disable_by_batch_size": 2})
    _add(scheduler, "a", list(range(5)))
    _add(scheduler, "b", list(range(7)))
    _step(scheduler, {"a": [1], "b": [2]}, {"a": [3, 4], "b": [5, 6]})
    out = _step(scheduler, {"a": [1], "b": [2]}, {})
    assert out.scheduled_spec_tokens == {}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def _finish(
    scheduler: Scheduler,
    out: SchedulerOutput,
    sampled: dict[str, list[int]],
    drafts: dict[str, list[int]],
) -> None:
    req_ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[sampled.get(req_id, []) for req_id in req_ids],
        draft_token_ids=drafts,
    )
    scheduler.update_from_output(out, runner)


def test_async_steps_verify_drafts_only_with_no_token_in_flight() -> None:
    """Async scheduling: a request with drafts waits for its token in flight (its drafts were
    proposed before it), verifies them, and is not run ahead of while the verify step runs; a
    request without drafts runs ahead every step."""
    scheduler = _scheduler(full(4), k=2, async_scheduling=True, spec={"disable_by_batch_size": 3})
    a = _add(scheduler, "a", list(range(5)))
    _add(scheduler, "b", list(range(6)))
    out1 = scheduler.schedule()  # both prefills
    out2 = scheduler.schedule()  # both run ahead (no drafts known)
    assert out2.num_scheduled_tokens == {"a": 1, "b": 1}
    _finish(scheduler, out1, {"a": [100], "b": [200]}, {"a": [1, 2]})
    out3 = scheduler.schedule()  # a has drafts: it waits for its token in flight
    assert out3.num_scheduled_tokens == {"b": 1}
    _finish(scheduler, out2, {"a": [101], "b": [201]}, {"a": [1, 2]})
    out4 = scheduler.schedule()  # a: no token in flight, verifies its drafts
    assert out4.scheduled_spec_tokens == {"a": [1, 2]}
    assert out4.num_scheduled_tokens == {"a": 3, "b": 1}
    _add(scheduler, "c", list(range(3)))  # 3 unfinished: drafting off from now on
    out5 = scheduler.schedule()  # a's verify step is in flight: not run ahead of all the same
    assert out5.num_scheduled_tokens == {"b": 1, "c": 3}
    scheduler.abort(["c"])  # drafting back on
    _finish(scheduler, out3, {"b": [202]}, {})
    _finish(scheduler, out4, {"a": [1, 60], "b": [203]}, {"a": [7, 8]})  # one accepted
    assert a.output_token_ids == [100, 101, 1, 60]
    assert a.num_computed_tokens == 8  # prompt, 100, 101, the accepted draft
    assert a.num_output_placeholders == 0
    out6 = scheduler.schedule()
    assert out6.scheduled_spec_tokens == {"a": [7, 8]}
    assert out6.num_scheduled_tokens == {"a": 3, "b": 1}
    scheduler.kv_cache_manager.check_invariants()


def test_async_steps_roll_nothing_back_for_a_request_preempted_mid_verify() -> None:
    """A request preempted while its verify step runs recomputes from scratch: the step's
    output only appends its tokens (no roll-back below zero, no restore of freed slots)."""
    scheduler = _scheduler(full(4), mamba(16, MambaCacheMode.NONE), k=2, async_scheduling=True)
    a = _add(scheduler, "a", list(range(5)))
    out1 = scheduler.schedule()
    _finish(scheduler, out1, {"a": [100]}, {"a": [1, 2]})
    out2 = scheduler.schedule()
    assert out2.scheduled_spec_tokens == {"a": [1, 2]}
    plan = StepPlan(budget=8)
    scheduler._preempt(a, plan)
    _finish(scheduler, out2, {"a": [1, 50]}, {"a": [3]})  # one of two accepted
    assert a.num_computed_tokens == 0
    assert a.output_token_ids == [100, 1, 50]
    assert scheduler.spec is not None
    assert not scheduler.spec.verifying
    out3 = scheduler.schedule()  # resumed: recomputes every known token
    assert out3.num_scheduled_tokens == {"a": 8}
    scheduler.kv_cache_manager.check_invariants()


@pytest.mark.parametrize("mode", [MambaCacheMode.ALL, MambaCacheMode.NONE])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_pool_capacity_loses_only_k_states_and_lookahead_blocks(
    k: int, mode: MambaCacheMode
) -> None:
    """Memory arithmetic during a verify step of requests at different positions (full,
    sliding-window and chunked-local groups, a Mamba group): the pool holds exactly k state
    blocks per drafting request (the draft-position states) plus, per attention group, the
    blocks its draft positions reach past the plain step's, more than at the same step without
    speculation (states at block ends, ALL: verify steps stop short of a block end, so no
    lookahead block; NONE: drafts cross block ends)."""
    block_size = 8
    attention = (full(block_size), window(block_size, 16), chunked(block_size, 16))
    prompts = [list(range(9)), list(range(11)), list(range(15)), list(range(20))]
    used, verified = {}, {}
    for num_drafts in (0, k):
        scheduler = _scheduler(*attention, mamba(block_size, mode), k=k)
        for index, prompt in enumerate(prompts):
            _add(scheduler, f"r{index}", prompt)
        drafts = {f"r{index}": [7] * num_drafts for index in range(len(prompts))}
        _step(scheduler, {req_id: [3] for req_id in drafts}, drafts)
        manager = scheduler.kv_cache_manager
        out = scheduler.schedule()  # the verify step (or the plain one): blocks held now
        verified = {req_id: len(d) for req_id, d in out.scheduled_spec_tokens.items()}
        used[num_drafts] = manager.pool.num_blocks - manager.num_free_blocks
        manager.check_invariants()
    assert len(verified) >= 2  # (ALL: the others stop short of a recurrent block end)
    lookahead = sum(
        -(-(len(prompts[int(req_id[1:])]) + 1 + m) // block_size)
        - -(-(len(prompts[int(req_id[1:])]) + 1) // block_size)
        for req_id, m in verified.items()
    )
    if mode is MambaCacheMode.NONE:
        assert lookahead > 0
    assert used[k] - used[0] == len(verified) * k + len(attention) * lookahead

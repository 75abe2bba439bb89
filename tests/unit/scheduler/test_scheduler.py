"""Scheduler steps: budget and seats, chunked prefill, prefix hits at admission, per-group block
IDs (scenario S30), block-aligned prefill splits (S20), stop conditions, aborts, rejections."""

from __future__ import annotations

import random

import pytest
from kv_cache_helpers import full, make_config, window
from scheduler_drive import ScriptedRunner, drive, make_request, make_scheduler, run_step
from scheduler_fake_runner import FakeModelRunner

from scheduler.kv_cache.spec import MambaCacheMode, MambaSpec
from scheduler.output import FinishReason
from scheduler.scheduler import Scheduler


def test_budget_and_max_num_seqs_hold_every_step() -> None:
    config = make_config(200, full(4))
    scheduler = make_scheduler(config, max_num_seqs=3, max_num_batched_tokens=20, max_model_len=64)
    rng = random.Random(0)
    requests = [
        make_request(
            scheduler,
            f"r{i}",
            [rng.randrange(1, 97) for _ in range(rng.randint(1, 30))],
            max_tokens=rng.randint(1, 10),
            eos=None,
        )
        for i in range(12)
    ]
    result = drive(scheduler, FakeModelRunner(config), {0: requests})
    assert result.max_batch_tokens == 20
    assert result.max_running == 3
    for request in requests:
        assert result.finish[request.req_id] is FinishReason.LENGTH
        assert len(result.tokens[request.req_id]) == request.sampling_params.max_tokens


def test_chunked_prefill_splits_by_budget() -> None:
    config = make_config(100, full(4))
    scheduler = make_scheduler(config, max_num_batched_tokens=16, max_model_len=128)
    scheduler.add_request(make_request(scheduler, "a", list(range(1, 51)), max_tokens=3, eos=None))
    runner = FakeModelRunner(config)
    chunks = []
    while scheduler.has_unfinished_requests():
        chunks.append(run_step(scheduler, runner)[0]["a"])
    assert chunks == [16, 16, 16, 2, 1, 1]


def test_long_prefill_threshold_caps_chunks_and_decodes_share_the_step() -> None:
    config = make_config(100, full(4))
    scheduler = make_scheduler(
        config, max_num_batched_tokens=32, long_prefill_token_threshold=8, max_model_len=128
    )
    scheduler.add_request(make_request(scheduler, "a", list(range(1, 21)), max_tokens=2, eos=None))
    scheduler.add_request(make_request(scheduler, "b", [7, 8, 9], max_tokens=5, eos=None))
    runner = FakeModelRunner(config)
    steps = [run_step(scheduler, runner)[0] for _ in range(5)]
    assert steps == [
        {"a": 8, "b": 3},
        {"a": 8, "b": 1},
        {"a": 4, "b": 1},
        {"a": 1, "b": 1},
        {"b": 1},
    ]


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_longer_than_the_remaining_budget_waits_without_chunking(chunked: bool) -> None:
    config = make_config(100, full(4))
    scheduler = make_scheduler(
        config, enable_chunked_prefill=chunked, max_num_batched_tokens=64, max_model_len=64
    )
    for req_id, length, first in (("a", 60, 1), ("b", 10, 100), ("c", 2, 200)):
        prompt = list(range(first, first + length))  # no shared prefix
        scheduler.add_request(make_request(scheduler, req_id, prompt, max_tokens=3, eos=None))
    runner = FakeModelRunner(config)
    first, second = run_step(scheduler, runner)[0], run_step(scheduler, runner)[0]
    if chunked:
        assert first == {"a": 60, "b": 4}
        assert second == {"a": 1, "b": 6, "c": 2}
    else:  # b waits whole; c queues behind it (first come, first served)
        assert first == {"a": 60}
        assert second == {"a": 1, "b": 10, "c": 2}


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_hit_at_admission(caching: bool) -> None:
    config = make_config(100, full(4))
    scheduler = make_scheduler(config, max_model_len=128, enable_prefix_caching=caching)
    shared = list(range(1, 25))  # 6 full blocks
    scheduler.add_request(make_request(scheduler, "a", [*shared, 50, 51], max_tokens=4, eos=None))
    runner = FakeModelRunner(config)
    assert run_step(scheduler, runner)[0] == {"a": 26}
    scheduler.add_request(make_request(scheduler, "b", [*shared, 60, 61, 62], max_tokens=2))
    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    hit = 24 if caching else 0
    assert new.num_computed_tokens == hit
    assert out.num_scheduled_tokens == {"a": 1, "b": 27 - hit}
    if caching:  # b's first six blocks are a's
        a_blocks = scheduler.kv_cache_manager.get_block_ids("a")[0]
        assert new.block_ids[0][:6] == a_blocks[:6]
    outputs = scheduler.update_from_output(out, runner.execute(out))
    assert {o.req_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": hit}
    result = drive(scheduler, runner)
    assert set(result.finish) == {"a", "b"}


def test_admission_waits_until_the_pool_has_room() -> None:
    config = make_config(11, full(4))  # 10 usable blocks
    scheduler = make_scheduler(config, max_model_len=40)
    scheduler.add_request(make_request(scheduler, "a", list(range(1, 31)), max_tokens=4, eos=None))
    scheduler.add_request(make_request(scheduler, "b", list(range(31, 43)), max_tokens=2, eos=None))
    runner = FakeModelRunner(config)
    steps = [run_step(scheduler, runner) for _ in range(6)]
    assert [counts for counts, _ in steps] == [
        {"a": 30},
        {"a": 1},
        {"a": 1},
        {"a": 1},
        {"b": 12},
        {"b": 1},
    ]
    assert steps[3][1][0].finish_reason is FinishReason.LENGTH
    assert scheduler.num_preemptions == 0
    # b was looked up in each of the five steps it waited or was admitted: counted once.
    assert scheduler.make_stats().prefix_cache_queries == (30 + 12,)


def test_s30_block_ids_of_new_and_running_requests() -> None:
    """Scenario S30: full + 2 x SW(32), bs 16, pool 21, r0 holding its blocks."""
    config = make_config(21, full(16), window(16, 32), window(16, 32))
    scheduler = make_scheduler(config, max_model_len=96, max_num_batched_tokens=96)
    p3 = [0] * 16 + [1] * 16 + [2] * 16
    manager = scheduler.kv_cache_manager
    r0 = make_request(scheduler, "r0", p3 + [3] * 7)
    blocks = manager.allocate_slots(r0, 55)
    assert blocks is not None
    assert blocks.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    scheduler.add_request(make_request(scheduler, "r1", p3 + [3] * 5, max_tokens=20, eos=None))
    runner = ScriptedRunner(scheduler, {"r1": [5] * 20})
    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.block_ids == ([1, 2, 3, 13], [0, 6, 7, 14], [0, 10, 11, 15])
    assert new.num_computed_tokens == 48
    assert out.num_scheduled_tokens == {"r1": 5}
    scheduler.update_from_output(out, runner.execute(out))
    for computed in range(53, 65):
        out = scheduler.schedule()
        (cached,) = out.scheduled_cached_reqs
        assert cached.num_computed_tokens == computed
        assert cached.new_token_ids == [5]
        if computed < 64:
            assert cached.new_block_ids is None
        else:
            assert cached.new_block_ids == ([16], [17], [18])
        if computed == 63:  # the window left block 1: nulled here, stale on the worker
            assert manager.get_block_ids("r1") == ([1, 2, 3, 13], [0, 0, 7, 14], [0, 0, 11, 15])
        scheduler.update_from_output(out, runner.execute(out))


def test_common_prefix_blocks_per_group_follow_the_running_set() -> None:
    """Scenario S23 through the scheduler: b hits a's three blocks in the step that admits both
    (a registers them when allocated); the window group never reports a common prefix."""
    config = make_config(30, full(4), window(4, 8))
    scheduler = make_scheduler(config, max_model_len=64)
    shared = list(range(1, 13))
    for req_id, last in (("a", 40), ("b", 41)):
        scheduler.add_request(make_request(scheduler, req_id, [*shared, last], eos=None))
    runner = FakeModelRunner(config)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 13, "b": 1}
    assert out.num_common_prefix_blocks == (3, 0)
    scheduler.update_from_output(out, runner.execute(out))
    scheduler.add_request(make_request(scheduler, "c", [90, 91], eos=None))
    out = scheduler.schedule()
    assert out.num_common_prefix_blocks == (0, 0)
    scheduler.update_from_output(out, runner.execute(out))
    scheduler.abort(["c"])
    assert scheduler.schedule().num_common_prefix_blocks == (3, 0)


def _mamba_scheduler(budget: int, threshold: int = 0) -> Scheduler:
    mamba = MambaSpec(
        block_size=4, shapes=((8,),), dtype_bytes=(4,), mamba_cache_mode=MambaCacheMode.ALIGN
    )
    return make_scheduler(
        make_config(40, full(4), mamba),
        max_model_len=64,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
    )


@pytest.mark.parametrize(
    ("prompt_len", "budget", "chunks"),
    [(10, 100, [8, 2]), (22, 6, [4, 4, 4, 4, 4, 2]), (3, 100, [3])],
)
def test_mamba_prefill_splits_at_block_boundaries(
    prompt_len: int, budget: int, chunks: list[int]
) -> None:
    """Scenario S20's block-aligned split rule."""
    scheduler = _mamba_scheduler(budget)
    scheduler.add_request(
        make_request(scheduler, "r", list(range(1, prompt_len + 1)), max_tokens=3)
    )
    runner = ScriptedRunner(scheduler, {"r": [50, 51, 52]})
    seen = [run_step(scheduler, runner)[0]["r"] for _ in range(len(chunks) + 2)]
    assert seen == [*chunks, 1, 1]


@pytest.mark.parametrize(
    ("budget", "prompt_len", "first", "second", "table"),
    [
        (100, 10, ([1, 2], [0, 3]), ([4], [5]), ([1, 2, 4], [0, 3, 5])),  # S20: chunks 8, 2
        # Chunks of two blocks: the Mamba delta carries its null padding, so a worker appending
        # it keeps the state at index 3 (the padding was once left out: [6] landed at index 2).
        (8, 20, ([1, 2], [0, 3]), ([4, 5], [0, 6]), ([1, 2, 4, 5], [0, 3, 0, 6])),
    ],
)
def test_mamba_prefill_block_ids(
    budget: int,
    prompt_len: int,
    first: tuple[list[int], ...],
    second: tuple[list[int], ...],
    table: tuple[list[int], ...],
) -> None:
    scheduler = _mamba_scheduler(budget)
    prompt = list(range(1, prompt_len + 1))
    scheduler.add_request(make_request(scheduler, "r", prompt, max_tokens=3))
    runner = ScriptedRunner(scheduler, {"r": [50, 51, 52]})
    out = scheduler.schedule()
    assert out.scheduled_new_reqs[0].block_ids == first
    scheduler.update_from_output(out, runner.execute(out))
    out = scheduler.schedule()
    assert out.scheduled_cached_reqs[0].new_block_ids == second
    assert scheduler.kv_cache_manager.get_block_ids("r") == table


def test_mamba_split_needs_chunks_of_a_block() -> None:
    with pytest.raises(ValueError, match="must be >= 4"):
        _mamba_scheduler(3)
    with pytest.raises(ValueError, match="must be >= 4"):
        _mamba_scheduler(100, threshold=2)


def test_stats_report_usage_hits_and_queues() -> None:
    config = make_config(30, full(4), window(4, 8))
    scheduler = make_scheduler(config, max_num_seqs=1, max_model_len=64)
    shared = list(range(1, 13))
    scheduler.add_request(make_request(scheduler, "a", [*shared, 40], max_tokens=2, eos=None))
    scheduler.add_request(make_request(scheduler, "b", [*shared, 41], max_tokens=2, eos=None))
    runner = FakeModelRunner(config)
    run_step(scheduler, runner)
    stats = scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(8 / 29)  # 4 blocks per group
    assert stats.kv_cache_usage_per_group == pytest.approx((4 / 29, 4 / 29))
    drive(scheduler, runner)
    stats = scheduler.make_stats()
    assert stats.prefix_cache_queries == (26, 26)
    assert stats.prefix_cache_hit_tokens == 12
    assert stats.num_preemptions == 0
    assert stats.kv_cache_usage == 0
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)


def test_a_failed_step_leaves_no_hit_on_its_blocks() -> None:
    """The workers fail a step: the blocks it registered (whose KV was never written) must not
    serve a later prompt, while blocks computed by earlier steps may."""
    config = make_config(40, full(4), window(4, 6))
    scheduler = make_scheduler(config, max_model_len=64, max_num_batched_tokens=12)
    prompt = list(range(1, 29))  # 7 full blocks, computed 12 tokens a step
    scheduler.add_request(make_request(scheduler, "a", prompt, max_tokens=2, eos=None))
    runner = FakeModelRunner(config)
    assert run_step(scheduler, runner)[0] == {"a": 12}  # blocks 0-2 computed
    failed = scheduler.schedule()  # would compute tokens 12-23, registering blocks 3-5
    scheduler.discard_failed_step(failed)
    scheduler.abort(["a"])
    scheduler.kv_cache_manager.check_invariants()
    scheduler.add_request(make_request(scheduler, "b", [*prompt, 99], max_tokens=1))
    out = scheduler.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens <= 12  # without the discard: 24, blocks 3-5 unwritten

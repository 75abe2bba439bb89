"""Preemption by recompute: victim choice, resume with complete block lists, and the same tokens
as an unconstrained run; 1,000 random requests on a full + sliding-window + chunked-local model
driven to completion with no block leaked and no more block allocations than the tokens computed
call for (the time a step takes is measured in the scheduler benchmark, not asserted here)."""

from __future__ import annotations

import random

import pytest
from kv_cache_helpers import chunked, full, make_config, window
from scheduler_drive import drive, make_request, make_scheduler
from scheduler_fake_runner import FakeModelRunner

from scheduler.config import SchedulingPolicy
from scheduler.kv_cache.block_pool import KVCacheBlock
from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.output import FinishReason, SchedulerOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler


def _run_steps(scheduler: Scheduler, runner: FakeModelRunner, count: int) -> list[SchedulerOutput]:
    outs = []
    for _ in range(count):
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out))
        outs.append(out)
    return outs


def test_fcfs_preempts_the_last_request_and_resumes_it_with_complete_lists() -> None:
    """Full attention, bs 4, 8 usable blocks: every block ID below follows the pool policy."""
    config = make_config(9, full(4))
    scheduler = make_scheduler(config, max_model_len=32)
    scheduler.add_request(make_request(scheduler, "a", list(range(1, 9)), max_tokens=10, eos=None))
    scheduler.add_request(
        make_request(scheduler, "b", list(range(11, 19)), max_tokens=20, eos=None)
    )
    runner = FakeModelRunner(config)
    outs = _run_steps(scheduler, runner, 11)
    assert [n.block_ids for n in outs[0].scheduled_new_reqs] == [([1, 2],), ([3, 4],)]
    assert [c.new_block_ids for c in outs[1].scheduled_cached_reqs] == [([5],), ([6],)]
    assert [c.new_block_ids for c in outs[5].scheduled_cached_reqs] == [([7],), ([8],)]
    # Step 9: a needs a block, none is free: b (the last) is preempted, its blocks go to the
    # free queue tail first ([8, 6, 4, 3]) and a takes 8.
    assert outs[9].preempted_req_ids == {"b"}
    assert outs[9].num_scheduled_tokens == {"a": 1}
    assert outs[9].scheduled_cached_reqs[0].new_block_ids == ([8],)
    # Step 10: a finished (10 tokens); b resumes from its cached blocks 3, 4, 6 (hit 12; block 8
    # lost its hash to a) and takes a's unhashed 8 and a's oldest-freed hashed block 7.
    assert outs[10].finished_req_ids == {"a"}
    (resumed,) = outs[10].scheduled_cached_reqs
    assert resumed.is_resumed
    assert resumed.req_id == "b"
    assert resumed.num_computed_tokens == 12
    assert resumed.new_block_ids == ([3, 4, 6, 8, 7],)
    assert resumed.new_block_ids == scheduler.kv_cache_manager.get_block_ids("b")
    assert len(resumed.new_token_ids) == 9
    assert outs[10].num_scheduled_tokens == {"b": 5}
    result = drive(scheduler, runner)
    assert result.finish == {"b": FinishReason.LENGTH}
    assert scheduler.make_stats().num_preemptions == 1


def _three_small_requests(scheduler: Scheduler) -> None:
    for req_id, priority, start in (("a", 0, 100), ("b", 5, 200), ("c", 1, 300)):
        prompt = list(range(start, start + 4))
        request = make_request(
            scheduler, req_id, prompt, 20, eos=None, priority=priority, arrival_time=start
        )
        scheduler.add_request(request)


@pytest.mark.parametrize(
    ("policy", "victim", "scheduled"),
    [
        (SchedulingPolicy.FCFS, "c", {"a": 1, "b": 1}),
        # b has the largest (priority, arrival): already scheduled, it is withdrawn.
        (SchedulingPolicy.PRIORITY, "b", {"a": 1, "c": 1}),
    ],
)
def test_preemption_victim_by_policy(
    policy: SchedulingPolicy, victim: str, scheduled: dict[str, int]
) -> None:
    config = make_config(9, full(4))  # a, b, c take 2 blocks each by position 8
    scheduler = make_scheduler(config, max_model_len=32, policy=policy)
    _three_small_requests(scheduler)
    runner = FakeModelRunner(config)
    outs = _run_steps(scheduler, runner, 5)
    assert all(not out.preempted_req_ids for out in outs)
    scheduler.add_request(make_request(scheduler, "d", [400], priority=0, arrival_time=400))
    out = scheduler.schedule()  # position 8: each needs a third block, 2 are free
    assert out.preempted_req_ids == {victim}
    assert out.num_scheduled_tokens == scheduled
    assert not out.scheduled_new_reqs  # no admission in a step that preempted
    scheduler.update_from_output(out, runner.execute(out))
    admitted = []  # (step, request) of every admission or resume after the preemption
    for step in range(200):
        out = scheduler.schedule()
        admitted += [(step, n.req_id) for n in out.scheduled_new_reqs]
        admitted += [(step, c.req_id) for c in out.scheduled_cached_reqs if c.is_resumed]
        scheduler.update_from_output(out, runner.execute(out))
    d_step = next(step for step, req_id in admitted if req_id == "d")
    if policy is SchedulingPolicy.FCFS:  # preempted requests go back to the queue front
        assert all(step <= d_step for step, _ in admitted)
        assert d_step > 0
    else:  # d (priority 0) is admitted at once, ahead of b (priority 5)
        assert admitted[0] == (0, "d")
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == 8


def _random_requests(
    scheduler: Scheduler, rng: random.Random, count: int, max_prompt: int, max_tokens: int
) -> list[Request]:
    prefixes = [
        [rng.randrange(1, 97) for _ in range(rng.randint(0, max_prompt // 2))] for _ in range(8)
    ]
    requests = []
    for i in range(count):
        suffix = [rng.randrange(1, 97) for _ in range(rng.randint(1, max_prompt // 2))]
        request = make_request(
            scheduler,
            f"r{i}",
            rng.choice(prefixes) + suffix,
            max_tokens=rng.randint(1, max_tokens),
            priority=rng.randint(0, 3),
            arrival_time=float(i),
        )
        requests.append(request)
    return requests


def _hybrid_config(num_blocks: int) -> KVCacheConfig:
    return make_config(num_blocks, full(4), window(4, 8))


@pytest.mark.parametrize("policy", list(SchedulingPolicy))
def test_preemption_and_resume_give_the_tokens_of_an_unconstrained_run(
    policy: SchedulingPolicy,
) -> None:
    results = {}
    for num_blocks in (1000, 30):  # 30: one max-length request (27 blocks) and little more
        config = _hybrid_config(num_blocks)
        scheduler = make_scheduler(
            config, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8, policy=policy
        )
        rng = random.Random(7)
        arrivals: dict[int, list[Request]] = {}
        for index, request in enumerate(_random_requests(scheduler, rng, 40, 40, 30)):
            arrivals.setdefault(index // 4, []).append(request)
        result = drive(scheduler, FakeModelRunner(config), arrivals)
        results[num_blocks] = (result.tokens, result.finish, scheduler.num_preemptions)
        assert scheduler.kv_cache_manager.num_free_blocks == num_blocks - 1
    tokens, finish, preemptions = results[30]
    assert preemptions > 5
    assert results[1000][2] == 0
    assert tokens == results[1000][0]
    assert finish == results[1000][1]
    assert len(finish) == 40


def test_thousand_random_requests_with_aborts_leak_no_block() -> None:
    config = make_config(120, full(4), window(4, 8), chunked(4, 8))
    scheduler = make_scheduler(config, max_model_len=64, max_num_batched_tokens=48, max_num_seqs=16)
    rng = random.Random(1234)
    requests = _random_requests(scheduler, rng, 1000, 40, 20)
    arrivals: dict[int, list[Request]] = {}
    arrival_step = {}
    for request in requests:
        arrival_step[request.req_id] = rng.randrange(600)
        arrivals.setdefault(arrival_step[request.req_id], []).append(request)
    abort_at: dict[int, list[str]] = {}
    for request in rng.sample(requests, 60):  # while waiting, running, or already finished
        step = arrival_step[request.req_id] + rng.randrange(25)
        abort_at.setdefault(step, []).append(request.req_id)

    def hook(step: int, _: Scheduler) -> list[str]:
        return abort_at.pop(step, [])

    runner = FakeModelRunner(config)
    counts = _count_work(scheduler)
    result = drive(scheduler, runner, arrivals, hook=hook)
    manager = scheduler.kv_cache_manager
    manager.check_invariants()
    assert manager.num_free_blocks == 119
    assert manager.usage == 0
    assert not scheduler.has_unfinished_requests()
    assert set(result.finish) == {r.req_id for r in requests}
    assert sum(reason is FinishReason.ABORT for reason in result.finish.values()) > 20
    assert scheduler.num_preemptions > 0
    out = scheduler.schedule()
    assert out.is_empty
    runner.execute(out)
    assert not runner.requests  # the workers were told about every finished request
    # Each run of a request (admission or resume to preemption or finish) takes per group at
    # most one block per 4 tokens it computes, plus one partly filled block.
    assert counts["blocks"] <= 3 * (counts["tokens"] // 4 + counts["runs"])


def _count_work(scheduler: Scheduler) -> dict[str, int]:
    """Counters of the blocks the pool hands out and of the tokens and request runs scheduled,
    kept up to date by wrappers around `get_new_blocks` and `schedule` (which still do the work)."""
    counts = {"blocks": 0, "tokens": 0, "runs": 0}
    pool = scheduler.kv_cache_manager.pool
    get_new_blocks, schedule = pool.get_new_blocks, scheduler.schedule

    def counting_get_new_blocks(count: int, group_id: int) -> list[KVCacheBlock]:
        counts["blocks"] += count
        return get_new_blocks(count, group_id)

    def counting_schedule() -> SchedulerOutput:
        out = schedule()
        counts["tokens"] += out.total_num_scheduled_tokens
        resumed = sum(data.is_resumed for data in out.scheduled_cached_reqs)
        counts["runs"] += len(out.scheduled_new_reqs) + resumed
        return out

    pool.get_new_blocks = counting_get_new_blocks  # type: ignore[method-assign]
    scheduler.schedule = counting_schedule  # type: ignore[method-assign]
    return counts

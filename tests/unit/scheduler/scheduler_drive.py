"""Driving a scheduler in tests: builders, a loop to completion with per-step checks, and a
scripted runner for exact token sequences."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from scheduler_fake_runner import EOS, FakeModelRunner

from scheduler.config import SchedulerConfig
from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.output import FinishReason, ModelRunnerOutput, RequestStepOutput, SchedulerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler


def make_scheduler(kv_cache_config: KVCacheConfig, **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), kv_cache_config)  # type: ignore[arg-type]


def make_request(
    scheduler: Scheduler,
    req_id: str,
    prompt: list[int],
    max_tokens: int = 8,
    eos: int | None = EOS,
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: object,
) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        hash_block_size=scheduler.hash_block_size,
        eos_token_id=eos,
        priority=priority,
        arrival_time=arrival_time,
    )


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    num_steps: int = 0
    max_batch_tokens: int = 0
    max_running: int = 0


def run_step(
    scheduler: Scheduler, runner: FakeModelRunner | ScriptedRunner
) -> tuple[dict[str, int], list[RequestStepOutput]]:
    """One schedule / execute / update round: (tokens scheduled per request, outputs)."""
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, runner.execute(out))
    return dict(out.num_scheduled_tokens), outputs


StepHook = Callable[[int, Scheduler], list[str]]
"""Called before each step with the step index; returns request IDs to abort."""


def drive(
    scheduler: Scheduler,
    runner: FakeModelRunner,
    arrivals: dict[int, list[Request]] | None = None,
    hook: StepHook | None = None,
    max_steps: int = 100_000,
    check_pool: bool = True,
) -> RunResult:
    """Run until every request finished, checking budget, seats, pool invariants and the workers'
    block tables after every step."""
    arrivals = dict(arrivals or {})
    result = RunResult()
    step = 0
    while scheduler.has_unfinished_requests() or arrivals:
        assert step < max_steps, "scheduler made no progress"
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if hook is not None:
            for output in scheduler.abort(hook(step, scheduler)):
                result.finish[output.req_id] = output.finish_reason  # type: ignore[assignment]
        out = scheduler.schedule()
        check_step(scheduler, out, runner.loaded_req_ids)
        result.max_batch_tokens = max(result.max_batch_tokens, out.total_num_scheduled_tokens)
        result.max_running = max(result.max_running, len(scheduler.running))
        for output in scheduler.update_from_output(out, runner.execute(out)):
            result.tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                result.finish[output.req_id] = output.finish_reason
        if check_pool:
            scheduler.kv_cache_manager.check_invariants()
        check_worker_tables(scheduler, runner)
        step += 1
    result.num_steps = step
    return result


def check_step(scheduler: Scheduler, out: SchedulerOutput, loaded: Collection[str] = ()) -> None:
    """Invariants of every step's message (`loaded`: requests admitted earlier that waited for
    offload-tier loads; they may be sent first in a step that preempts)."""
    config = scheduler.config
    counts = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(counts.values())
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(counts) <= config.max_num_seqs
    assert len(scheduler.running) <= config.max_num_seqs
    assert all(n >= 1 for n in counts.values())
    assert not (out.preempted_req_ids & set(counts))
    if out.preempted_req_ids:  # no admission in a step that preempted
        assert all(r.req_id in loaded for r in out.scheduled_new_reqs)
        assert all(r.req_id in loaded for r in out.scheduled_cached_reqs if r.is_resumed)
    for request in scheduler.running:  # placeholders: async scheduling's tokens in flight
        assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders
        assert request.num_output_placeholders <= 2


def check_worker_tables(scheduler: Scheduler, runner: FakeModelRunner) -> None:
    """What the workers built from the deltas is the scheduler's table, or a stale ID where the
    scheduler nulled an entry (S30: nulled entries are not sent)."""
    for request in scheduler.running:
        if request.req_id not in runner.requests:
            assert request.num_computed_tokens == request.num_cached_tokens  # loaded, unsent
            continue
        worker_tables = runner.requests[request.req_id].block_ids
        if worker_tables is None:  # preempted, back from its loads, not resumed yet
            assert request.req_id in scheduler._worker_view._resumed_req_ids
            continue
        tables = scheduler.kv_cache_manager.get_block_ids(request.req_id)
        for worker_ids, ids in zip(worker_tables, tables, strict=True):
            assert len(worker_ids) == len(ids), (request.req_id, worker_ids, ids)
            assert all(i in (0, w) for w, i in zip(worker_ids, ids, strict=True)), (worker_ids, ids)


class ScriptedRunner:
    """Returns scripted tokens for requests whose step reaches their last known token."""

    def __init__(self, scheduler: Scheduler, script: dict[str, list[int]]) -> None:
        self.scheduler = scheduler
        self.script = {req_id: list(tokens) for req_id, tokens in script.items()}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = []
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([self.script[req_id].pop(0)] if done else [])
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)

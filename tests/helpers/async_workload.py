"""A mixed workload driven through an engine core step by step, for comparing synchronous steps
with async scheduling: greedy and seeded requests, `n` samples, stop tokens, shared prompt
prefixes (prefix hits), and a second wave added while steps are in flight."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config.engine_args import EngineArgs
from cluster.engine.core import EngineCore, build_engine_core
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams

SHARED_PREFIX = [(7 * i + 3) % 251 for i in range(12)]
STOP_TOKENS = tuple(range(1, 256, 9))
"""Many stop tokens: seeded requests hit one after a few tokens."""


@dataclass(frozen=True)
class RunResult:
    samples: dict[tuple[str, int], tuple[tuple[int, ...], str | None]]
    """(request ID, sample index) -> (tokens, finish reason)."""
    num_preemptions: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache, over every request."""
    num_scheduled_ahead: int
    """Requests scheduled while their previous token was still in flight (async steps)."""


def _params(index: int) -> SamplingParams:
    max_tokens = 6 + (index * 5) % 11
    if index % 3 == 0:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if index % 3 == 1:
        return SamplingParams(temperature=1.0, seed=100 + index, max_tokens=max_tokens, n=2)
    return SamplingParams(
        temperature=0.8, seed=200 + index, max_tokens=max_tokens, stop_token_ids=STOP_TOKENS
    )


def workload(wave: int, num_requests: int = 6) -> list[EngineRequest]:
    """Requests of one wave; every other one shares `SHARED_PREFIX`."""
    requests = []
    for i in range(num_requests):
        own = [(13 * i + 5 * j + wave + 1) % 256 for j in range(3 + 2 * i)]
        prompt = SHARED_PREFIX + own if i % 2 == 0 else own + SHARED_PREFIX
        requests.append(EngineRequest(f"w{wave}-{i}", tuple(prompt), _params(i)))
    return requests


def run_workload(core: EngineCore, num_requests: int = 6) -> RunResult:
    """Both waves through `core` (the second added after three steps); every sample's tokens."""
    samples: dict[tuple[str, int], tuple[tuple[int, ...], str | None]] = {}
    cached = 0
    for request in workload(0, num_requests):
        core.add_request(request)
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        if steps == 3:
            for request in workload(1, num_requests):
                core.add_request(request)
        for delta in core.step():
            for out in delta.outputs:
                tokens, _ = samples.get((delta.request_id, out.index), ((), None))
                samples[(delta.request_id, out.index)] = (
                    tokens + tuple(out.token_ids),
                    out.finish_reason,
                )
            if delta.finished:
                cached += delta.num_cached_tokens
    scheduler = core.scheduler
    return RunResult(samples, scheduler.num_preemptions, cached, scheduler.num_scheduled_ahead)


def run_engine(args: EngineArgs, num_requests: int = 6) -> RunResult:
    core = build_engine_core(args)
    try:
        return run_workload(core, num_requests)
    finally:
        core.shutdown()

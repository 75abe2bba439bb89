"""A bounded chaos run against an OpenAI endpoint: good requests mixed with bad inputs and
clients that go away, with one worker (rank actor) kill partway through.

Every request has a deadline; the report counts good requests completed, good requests failed
(by the kill, which must answer that the model is unavailable, and any other), bad inputs
answered with a 4xx and with a 5xx (must be 0), requests that hung (must be 0), and the model
replica's KV usage once the run is over (must be 0). The requests are drawn from a seed before
the run, so a run can be repeated.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import openai

from tests.helpers.traffic import Outcome, client, stream_completion


@dataclass(frozen=True)
class ChaosPlan:
    """What one run sends."""

    num_requests: int = 30
    concurrency: int = 4
    seed: int = 0
    deadline_s: float = 60.0
    """A request not ended this long after it was sent has hung."""
    bad_fraction: float = 0.3
    disconnect_fraction: float = 0.2
    kill_at: float = 0.3
    """The worker is killed when this fraction of the requests has been sent."""
    max_tokens: int = 16


@dataclass(frozen=True)
class ChaosReport:
    """What one run saw."""

    good_completed: int
    good_failed_by_kill: int
    good_failed_other: int
    bad_4xx: int
    bad_5xx: int
    disconnects: int
    hung: int
    seconds: float
    good_latency_p50_s: float
    """Median time of the good requests that completed (whole stream)."""
    good_latency_max_s: float
    errors: tuple[str, ...]
    """Distinct errors of the good requests that failed and of bad inputs not given a 4xx."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class _Request:
    kind: str
    path: str = ""
    body: str = ""
    prompt: str = ""
    chunks: int = 0
    """For a disconnect: chunks read before the client goes away."""


def bad_requests(model: str, max_model_len: int) -> list[tuple[str, str]]:
    """(path, raw body) pairs that a correct server answers with a 4xx."""
    too_long = " ".join(f"t{i % 200 + 1}" for i in range(max_model_len + 10))
    bodies: list[tuple[str, object]] = [
        ("/v1/completions", '{"model": "' + model + '", "prompt": '),
        ("/v1/completions", "[1, 2]"),
        ("/v1/completions", {"model": model, "prompt": "t1", "temperature": -1}),
        ("/v1/completions", {"model": model, "prompt": "t1", "max_tokens": -1}),
        ("/v1/completions", {"model": model, "prompt": "t1", "n": 0}),
        ("/v1/completions", {"model": model, "prompt": "t1", "logprobs": 99}),
        ("/v1/completions", {"model": "no-such-model", "prompt": "t1"}),
        ("/v1/completions", {"model": model, "prompt": too_long, "max_tokens": 4}),
        ("/v1/completions", {"model": model, "prompt": "t1", "max_tokens": 10**7}),
        ("/v1/completions", {"model": model, "prompt": [1, 2, 10**9]}),
        ("/v1/chat/completions", {"model": model, "messages": []}),
        ("/v1/chat/completions", {"model": model, "messages": "hi", "stream": True}),
    ]
    return [(path, b if isinstance(b, str) else json.dumps(b)) for path, b in bodies]


def draw_requests(plan: ChaosPlan, model: str, max_model_len: int) -> list[_Request]:
    """The run's requests, in sending order, from the plan's seed."""
    rng = random.Random(plan.seed)
    bad = bad_requests(model, max_model_len)
    num_bad = round(plan.bad_fraction * plan.num_requests)
    num_disconnects = round(plan.disconnect_fraction * plan.num_requests)
    kinds = ["bad"] * num_bad + ["disconnect"] * num_disconnects
    kinds += ["good"] * (plan.num_requests - len(kinds))
    rng.shuffle(kinds)
    requests = []
    for kind in kinds:
        if kind == "bad":
            path, body = rng.choice(bad)
            requests.append(_Request(kind, path=path, body=body))
        elif kind == "disconnect":
            requests.append(_Request(kind, chunks=rng.randrange(3)))
        else:
            words = [f"t{rng.randrange(1, 200)}" for _ in range(rng.randrange(3, 12))]
            requests.append(_Request(kind, prompt=" ".join(words)))
    return requests


async def _bad(http: httpx.AsyncClient, request: _Request, deadline_s: float) -> Outcome:
    started = time.monotonic()
    headers = {"Content-Type": "application/json"}
    try:
        response = await asyncio.wait_for(
            http.post(request.path, content=request.body, headers=headers), timeout=deadline_s
        )
    except asyncio.TimeoutError:
        return Outcome("bad", started, time.monotonic(), hung=True, error=request.body[:80])
    status = response.status_code
    error = None if 400 <= status < 500 else f"{status} for {request.body[:80]}: {response.text}"
    return Outcome("bad", started, time.monotonic(), status=status, error=error)


async def _read_then_leave(http: httpx.AsyncClient, model: str, chunks: int) -> None:
    body = {"model": model, "prompt": "t3 t4 t5", "max_tokens": 200, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            chunks -= bool(line)
            if chunks <= 0:
                return


async def _disconnect(
    http: httpx.AsyncClient, model: str, request: _Request, deadline_s: float
) -> Outcome:
    """A streaming request whose client goes away after `request.chunks` chunks."""
    started = time.monotonic()
    try:
        await asyncio.wait_for(_read_then_leave(http, model, request.chunks), timeout=deadline_s)
    except asyncio.TimeoutError:
        return Outcome("disconnect", started, time.monotonic(), hung=True)
    except httpx.HTTPError as error:  # the worker kill may end it first: not the point here
        return Outcome("disconnect", started, time.monotonic(), error=str(error))
    return Outcome("disconnect", started, time.monotonic())


class _Run:
    """One run: the drawn requests, the outcomes, the kill's trigger."""

    def __init__(self, model: str, requests: list[_Request], plan: ChaosPlan) -> None:
        self.model, self.requests, self.plan = model, requests, plan
        self.outcomes: list[Outcome] = []
        self.next_index = 0
        self.kill_index = int(plan.kill_at * plan.num_requests)

    async def send(
        self, request: _Request, api: openai.AsyncOpenAI, http: httpx.AsyncClient
    ) -> Outcome:
        deadline = self.plan.deadline_s
        if request.kind == "bad":
            return await _bad(http, request, deadline)
        if request.kind == "disconnect":
            return await _disconnect(http, self.model, request, deadline)
        return await stream_completion(
            api, self.model, request.prompt, self.plan.max_tokens, deadline
        )

    async def worker(
        self, api: openai.AsyncOpenAI, http: httpx.AsyncClient, kill: Callable[[], Any]
    ) -> None:
        while self.next_index < len(self.requests):
            index = self.next_index
            self.next_index += 1
            if index == self.kill_index:  # this worker kills; the others keep sending
                await asyncio.to_thread(kill)
            self.outcomes.append(await self.send(self.requests[index], api, http))


def summarize(outcomes: list[Outcome], seconds: float) -> ChaosReport:
    """The report of a run's outcomes."""
    good = [o for o in outcomes if o.kind == "good" and not o.hung]
    failed = [o for o in good if not o.completed]
    bad = [o for o in outcomes if o.kind == "bad" and not o.hung]
    latencies = [o.seconds for o in good if o.completed]
    return ChaosReport(
        good_completed=sum(o.completed for o in good),
        good_failed_by_kill=sum(o.is_unavailable for o in failed),
        good_failed_other=sum(not o.is_unavailable for o in failed),
        bad_4xx=sum(o.error is None for o in bad),
        bad_5xx=sum(o.status is not None and o.status >= 500 for o in bad),
        disconnects=sum(o.kind == "disconnect" for o in outcomes),
        hung=sum(o.hung for o in outcomes),
        seconds=round(seconds, 1),
        good_latency_p50_s=round(statistics.median(latencies), 3) if latencies else 0.0,
        good_latency_max_s=round(max(latencies), 3) if latencies else 0.0,
        errors=tuple(sorted({o.error or "" for o in failed + [o for o in bad if o.error]})),
    )


async def run_chaos(
    base_url: str, model: str, max_model_len: int, plan: ChaosPlan, kill: Callable[[], Any]
) -> ChaosReport:
    """Send the plan's requests at its concurrency; `kill` runs once (in a thread, while the
    other clients go on sending)."""
    run = _Run(model, draw_requests(plan, model, max_model_len), plan)
    api = client(base_url, plan.deadline_s)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=plan.deadline_s + 30) as http:
        try:
            await asyncio.gather(*(run.worker(api, http, kill) for _ in range(plan.concurrency)))
        finally:
            await api.close()
    return summarize(run.outcomes, time.monotonic() - started)


def rank_actors() -> dict[str, str]:
    """The live engine rank actors (`hybridserve-…-rankN`): name -> namespace."""
    import ray

    return {
        str(actor["name"]): str(actor["namespace"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("hybridserve-") and "-rank" in actor["name"]
    }


def kill_a_rank(skip: Collection[str] = ()) -> str:
    """Kill one engine rank actor, not one named in `skip` (ranks of other engines); its name."""
    import ray

    ranks = {name: ns for name, ns in rank_actors().items() if name not in skip}
    assert ranks, "no rank actor to kill"
    victim = min(ranks)
    ray.kill(ray.get_actor(victim, namespace=ranks[victim]), no_restart=True)
    return victim


def wait_until_idle(stats: Callable[[], dict[str, Any]], timeout: float = 30.0) -> dict[str, Any]:
    """Poll a replica's `stats()` until nothing runs, waits or holds KV blocks; the last one."""
    deadline = time.monotonic() + timeout
    while True:
        current = stats()
        idle = not current["num_running"] and not current["num_waiting"]
        if (idle and current["kv_cache_usage"] == 0) or time.monotonic() > deadline:
            return current
        time.sleep(0.2)

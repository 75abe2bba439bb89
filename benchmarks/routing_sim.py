"""Replicas simulated in one process for the routing benchmark: the real scheduler and hybrid KV
coordinator per replica, no model (a token is a hash of its request and position), multi-session
chat traffic, and the routers compared: round-robin, Ray's prefix-cache affinity policy on Ray's
own `PrefixTree`, and `HybridRoutingPolicy` fed by the replicas' KV events.

Time is the step: every replica steps once per tick; a finished turn's session sends its next turn
(previous prompt + answer + a new user message) a few ticks later. Events reach the router
`event_delay` ticks after the step that made them (the poll period of the real deployment).
"""

from __future__ import annotations

import random
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Protocol

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

from cluster.serve.hybrid_policy import HybridRoutingPolicy
from cluster.serve.routing_options import RoutingOptions
from scheduler.config import SchedulerConfig
from scheduler.kv_cache.events import KVEventLog, KVEventWindow
from scheduler.kv_cache.spec import KVCacheConfig, KVCacheSpec, MambaCacheMode
from scheduler.kv_cache.spec_factory import make_spec, one_layer_groups_config
from scheduler.kv_cache.transfer import (
    commit_import,
    demote_export,
    find_export,
    held_keys,
    reserve_import,
)
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler

VOCAB = 32000
STEP_S = 0.025
"""Seconds per simulated step, to read the router's time options (half-life, guess lifetime)."""
MODELS: dict[str, list[KVCacheSpec]] = {
    "sliding+full": [make_spec("full_attention", 16), make_spec("sliding_window", 16, 128)],
    "mamba+full": [
        make_spec("full_attention", 16),
        make_spec("mamba", 16, mamba_cache_mode=MambaCacheMode.ALIGN),
    ],
}


@dataclass(frozen=True)
class Workload:
    """Multi-session chat: a shared system prompt, then turns that grow each session."""

    num_sessions: int
    num_turns: int = 6
    system_tokens: int = 96
    first_user_tokens: tuple[int, int] = (96, 320)
    user_tokens: tuple[int, int] = (24, 96)
    output_tokens: tuple[int, int] = (16, 64)
    think_ticks: tuple[int, int] = (10, 100)
    """Steps between an answer and the next turn (a step is some 10-50 ms on a GPU)."""
    seed: int = 0


@dataclass
class Session:
    """One conversation, its randomness its own: every router (and the reference) plays the
    same trace, whatever order turns finish in."""

    history: list[int]
    turns_left: int
    rng: random.Random
    due: int = 0


class Router(Protocol):
    name: str

    def choose(
        self, replicas: list[SimReplica], token_ids: list[int], now: int, session: int
    ) -> int: ...
    def start(self, replicas: list[SimReplica]) -> None: ...
    def on_step(self, replicas: list[SimReplica], now: int) -> None: ...
    def finished(self, replica: int) -> None: ...


class SimReplica:
    """One engine: a scheduler and a runner that needs no model."""

    def __init__(self, kv_config: KVCacheConfig, sched: SchedulerConfig, events: bool) -> None:
        self.scheduler = Scheduler(sched, kv_config)
        self.clock = 0.0
        self.log: KVEventLog | None = None
        if events:
            self.scheduler.kv_cache_manager.enable_events()
            self.log = KVEventLog(
                kv_config.groups,
                max_age_s=1e9,
                clock=lambda: self.clock,
                num_blocks=kv_config.num_blocks,
            )
        self.num_routed = 0
        self.num_computed_tokens = 0
        self.live: list[Request] = []

    def step(self) -> list[Request]:
        """One engine step; the requests it finished."""
        scheduler = self.scheduler
        if scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            self.num_computed_tokens += out.total_num_scheduled_tokens
            scheduler.update_from_output(out, self._sample(out))
            if self.log is not None:
                manager = scheduler.kv_cache_manager
                self.log.record(manager.take_events(), manager.eviction_outlook(scheduler.running))
        done = [r for r in self.live if r.status.is_finished]
        if done:
            self.live = [r for r in self.live if not r.status.is_finished]
        return done

    def add(self, request: Request) -> None:
        self.num_routed += 1
        self.scheduler.add_request(request)
        self.live.append(request)

    def _sample(self, out: SchedulerOutput) -> ModelRunnerOutput:
        requests = self.scheduler.requests
        sampled = []
        for req_id in out.num_scheduled_tokens:
            request = requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([token_at(req_id, request.num_tokens)] if done else [])
        return ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)


def token_at(req_id: str, position: int) -> int:
    return 1 + zlib.crc32(f"{req_id}:{position}".encode()) % (VOCAB - 1)


class BlindRouter:
    """A router that reads nothing of the replicas: no polls, no completions."""

    def start(self, replicas: list[SimReplica]) -> None:
        pass

    def on_step(self, replicas: list[SimReplica], now: int) -> None:
        pass

    def finished(self, replica: int) -> None:
        pass


class RoundRobin(BlindRouter):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = count()

    def choose(
        self, replicas: list[SimReplica], token_ids: list[int], now: int, session: int
    ) -> int:
        return next(self._next) % len(replicas)


class FixedPlacement(BlindRouter):
    """Each conversation on the replica a given placement names, every turn (what any router
    that keeps a conversation where it began does, with that placement); the sessions are
    known to it, which no real router knows."""

    name = "fixed placement"

    def __init__(self, placement: list[int]) -> None:
        self.placement = placement

    def choose(
        self, replicas: list[SimReplica], token_ids: list[int], now: int, session: int
    ) -> int:
        return self.placement[session]


def balanced_placements(
    num_sessions: int, num_replicas: int, count: int, seed: int
) -> list[list[int]]:
    """`count` random placements of the sessions, the same number on each replica (±1)."""
    rng = random.Random(f"placements:{seed}")
    placements = []
    for _ in range(count):
        placement = [number % num_replicas for number in range(num_sessions)]
        rng.shuffle(placement)
        placements.append(placement)
    return placements


class RayPrefixAffinity(BlindRouter):
    """Ray Serve LLM's `PrefixCacheAffinityRouter` decision on Ray's `PrefixTree` (prompt text:
    token IDs joined by spaces, as our subclass routes them): the replicas with the longest
    matched prefix when it covers >= 10 % of the text, else those with the fewest characters
    indexed; the least loaded of them."""

    name = "ray-prefix-affinity"

    def __init__(self, num_replicas: int, match_rate_threshold: float = 0.1) -> None:
        self.tree = PrefixTree()
        self.tenants = [f"r{i}" for i in range(num_replicas)]
        self.tree.add_tenants(self.tenants, 0.0)
        self.match_rate_threshold = match_rate_threshold
        self.in_flight = [0] * num_replicas

    def choose(
        self, replicas: list[SimReplica], token_ids: list[int], now: int, session: int
    ) -> int:
        text = " ".join(map(str, token_ids))
        matched, tenants = self.tree.prefix_match(text, self.tenants)
        if len(matched) / len(text) < self.match_rate_threshold or not tenants:
            tenants = self.tree.get_smallest_tenants() or self.tenants
        chosen = min((self.tenants.index(t) for t in tenants), key=lambda i: self.in_flight[i])
        self.tree.insert(text, self.tenants[chosen], float(now))
        self.in_flight[chosen] += 1
        return chosen

    def finished(self, replica: int) -> None:
        self.in_flight[replica] -= 1


class HybridPrefix:
    """`HybridRoutingPolicy`, its indexes fed by each replica's event log `delay` ticks late."""

    name = "hybrid-prefix (ours)"

    def __init__(
        self,
        num_replicas: int,
        delay: int,
        load_factor: float,
        pull_threshold: int | None = None,
        pressure_factor: float | None = RoutingOptions.pressure_factor,
    ) -> None:
        """`pull_threshold` (tokens): when the chosen replica's predicted hit trails another's
        by at least this much, the chosen one pulls the prefix from it (None: never);
        `pressure_factor`: the policy's pool-pressure rule (None: off)."""
        options = RoutingOptions(
            load_factor, event_age_steps=delay + 1, pressure_factor=pressure_factor
        )
        self.policy: HybridRoutingPolicy[int] = HybridRoutingPolicy(options)
        self.delay = delay
        self._pending: deque[tuple[int, list[tuple[KVEventWindow, float]]]] = deque()
        self.predictions: dict[str, tuple[int, int]] = {}
        """Request ID -> (replica, predicted hit)."""
        self._next_id = count()
        self.pull_threshold = pull_threshold
        self.pull_from: int | None = None
        """The replica the last chosen one pulls the prompt's prefix from (None: recompute)."""
        if pull_threshold is not None:
            self.name = "hybrid-prefix + pull (ours)"
        self.drained: set[int] = set()
        """Replicas taken out of routing (draining: alive, their caches still readable)."""

    def choose(
        self, replicas: list[SimReplica], token_ids: list[int], now: int, session: int
    ) -> int:
        keys = self.policy.prompt_keys(token_ids, None)
        seconds = now * STEP_S
        serving = [r for r in range(len(replicas)) if r not in self.drained]
        ranks = self.policy.choose(serving, keys, seconds)
        chosen = ranks[0][0]
        self._last = (chosen, self.policy.predicted_hit(chosen, keys, seconds))
        self.pull_from = None
        if self.pull_threshold is not None:
            hint = self.policy.pull_source(chosen, keys, seconds, self.pull_threshold)
            self.pull_from = hint.source if hint is not None else None
        self.policy.routed(chosen, keys, seconds)
        return chosen

    def start(self, replicas: list[SimReplica]) -> None:
        """The first poll, once the replicas are up and before traffic: their (empty) logs
        tell the router the block size and the groups."""
        for key, replica in enumerate(replicas):
            if replica.log is not None:
                self.policy.replay(key, replica.log.window())

    def on_step(self, replicas: list[SimReplica], now: int) -> None:
        polled = [
            (replica.log.window(), replica.scheduler.kv_cache_manager.usage)
            for replica in replicas
            if replica.log is not None
        ]
        self._pending.append((now + self.delay, polled))
        while self._pending and self._pending[0][0] <= now:
            _, ready = self._pending.popleft()
            for key, (window, usage) in enumerate(ready):
                self.policy.replay(key, window, usage, now=now * STEP_S)

    def finished(self, replica: int) -> None:
        self.policy.completed(replica)


def pull_between(sender: SimReplica, receiver: SimReplica, token_ids: list[int]) -> int:
    """The receiver takes the sender's cached prefix of the prompt (the scheduler's side of a
    KV transfer: held keys, the sender's minimal hybrid set, import; the sender then demotes
    what it sent, as a Serve replica does for a peer's pull); the tokens it covers."""
    take = receiver.scheduler.kv_cache_manager
    probe = Request("pull", list(token_ids), SamplingParams(), take.hash_block_size)
    held = held_keys(take, probe.block_hashes, "sim")
    give = sender.scheduler.kv_cache_manager
    plan = find_export(give, probe.block_hashes, len(token_ids) - 1, held, "sim")
    if not plan.keys.num_blocks:
        return 0
    reservation = reserve_import(take, plan.keys)
    if reservation is None:
        return 0
    commit_import(take, reservation)
    demote_export(give, plan)
    return plan.keys.num_hit_tokens


@dataclass
class RunResult:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    num_pulls: int = 0
    pulled_tokens: int = 0
    """Prefix tokens the pulls covered (hits of the receiving replica once imported)."""
    routed: list[int] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)
    prediction_pairs: list[tuple[int, int]] = field(default_factory=list)
    """(predicted, actual) hit per request routed by our policy."""
    recomputed_tokens: int = 0
    """Of the turns that left a drained replica, the tokens of their earlier history computed
    again (not hit) on the replica they moved to."""
    ticks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)


@dataclass
class DrainLedger:
    """A replica drained mid-run: the turns that leave it, and what their new replica computes
    again of their earlier history."""

    drain: tuple[int, int] | None
    """(tick, replica), or None: nothing drains."""
    last_served: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Session -> (replica, history tokens) of its last finished turn."""
    moved: dict[str, int] = field(default_factory=dict)
    """Request ID -> earlier history tokens, for turns that left the drained replica."""

    def start_drain(self, router: Router, tick: int) -> None:
        if self.drain is not None and tick >= self.drain[0] and isinstance(router, HybridPrefix):
            router.drained.add(self.drain[1])

    def routed(self, req_id: str, session: int, chosen: int) -> None:
        previous = self.last_served.get(session)
        if self.drain is None or previous is None:
            return
        if previous[0] == self.drain[1] != chosen:
            self.moved[req_id] = previous[1]

    def finished(self, request: Request, session: int, replica: int) -> int:
        """Tokens of the finished turn's earlier history it computed again (0 unless moved)."""
        self.last_served[session] = (replica, request.num_tokens)
        earlier = self.moved.pop(request.req_id, 0)
        return max(0, earlier - (request.num_cached_tokens or 0))


def _draw(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(*bounds)


def _user_message(rng: random.Random, bounds: tuple[int, int]) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(_draw(rng, bounds))]


def _session(workload: Workload, system: list[int], rng: random.Random) -> Session:
    history = system + _user_message(rng, workload.first_user_tokens)
    due = rng.randrange(0, 4 * workload.num_sessions)
    return Session(history, workload.num_turns, rng, due)


def run(
    workload: Workload,
    kv_config: KVCacheConfig,
    sched: SchedulerConfig,
    num_replicas: int,
    make_router: Callable[[int], Router],
    events: bool | None = None,
    drain: tuple[int, int] | None = None,
) -> RunResult:
    """Play the workload through `num_replicas` simulated replicas behind one router;
    `drain` = (tick, replica): from that tick on, our router sends nothing to the replica."""
    rng = random.Random(workload.seed)
    system = [_draw(rng, (1, VOCAB - 1)) for _ in range(workload.system_tokens)]
    sessions = [
        _session(workload, system, random.Random(f"{workload.seed}:{number}"))
        for number in range(workload.num_sessions)
    ]
    router = make_router(num_replicas)
    if events is None:  # only our router reads them
        events = isinstance(router, HybridPrefix)
    replicas = [SimReplica(kv_config, sched, events) for _ in range(num_replicas)]
    router.start(replicas)
    owner: dict[str, tuple[int, int, Request]] = {}
    ledger = DrainLedger(drain)
    result = RunResult()
    ids = count()
    tick = 0
    while any(s.turns_left for s in sessions) or owner:
        for number, session in enumerate(sessions):
            if session.turns_left and session.due == tick:
                session.turns_left -= 1
                session.due = -1
                req_id = f"s{number}-{next(ids)}"
                ledger.start_drain(router, tick)
                chosen = router.choose(replicas, session.history, tick, number)
                ledger.routed(req_id, number, chosen)
                source = getattr(router, "pull_from", None)
                if source is not None:
                    pulled = pull_between(replicas[source], replicas[chosen], session.history)
                    result.num_pulls += pulled > 0
                    result.pulled_tokens += pulled
                params = SamplingParams(
                    max_tokens=_draw(session.rng, workload.output_tokens), ignore_eos=True
                )
                request = Request(
                    req_id,
                    list(session.history),
                    params,
                    replicas[chosen].scheduler.hash_block_size,
                )
                replicas[chosen].add(request)
                owner[req_id] = (chosen, number, request)
                if isinstance(router, HybridPrefix):
                    router.predictions[req_id] = router._last
        for index, replica in enumerate(replicas):
            replica.clock = float(tick)
            for request in replica.step():
                _, number, _ = owner.pop(request.req_id)
                router.finished(index)
                session = sessions[number]
                session.history = request.all_token_ids + _user_message(
                    session.rng, workload.user_tokens
                )
                session.due = tick + _draw(session.rng, workload.think_ticks)
                result.prompt_tokens += request.num_prompt_tokens
                result.hit_tokens += request.num_cached_tokens or 0
                result.recomputed_tokens += ledger.finished(request, number, index)
                if isinstance(router, HybridPrefix):
                    _, predicted = router.predictions.pop(request.req_id)
                    result.prediction_pairs.append((predicted, request.num_cached_tokens or 0))
        router.on_step(replicas, tick)
        tick += 1
    result.routed = [r.num_routed for r in replicas]
    result.computed = [r.num_computed_tokens for r in replicas]
    result.ticks = tick
    return result


def model_config(model: str, num_blocks: int) -> KVCacheConfig:
    return one_layer_groups_config(num_blocks, MODELS[model])

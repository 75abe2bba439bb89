"""Drain hand-off: a replica Serve stops (scaled down) has its recent conversations' cached
prefixes pulled by peer replicas before it exits, so their next turns hit there, not recompute.

    replica: each finished request ─► RecentPrefixes (its prompt + output tokens, bounded)
    Serve stops the replica: out of routing ─► in-flight requests finish ─► destructor
        ─► DrainHandoff.run: the most recent prefixes whose cached hit here exceeds
           pull_threshold_tokens (a shorter one is cheaper to recompute), each assigned to a
           peer replica in turn ─► peer.accept_handoff (called on the peer's actor itself)
           ─► the peer pulls it from here with the pull path of `peer_pull` (its pull counter)
        ─► the engine stops
    router: the peers' KV events (routing stats) show the prefixes there ─► next turns go there

A peer that is handing off itself (also stopped) refuses; its prefixes go to another peer.
The whole hand-off runs within the replica's graceful_shutdown_timeout_s (less one drain
loop); what does not make it is recomputed on the peer, never lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import ray
from ray import serve
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.request_router import ReplicaID

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.core import EngineCore
from cluster.engine.kv_transfer import prompt_probe
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.serve.hybrid_router import kv_events_enabled
from cluster.serve.peer_pull import ReplicaCall, call_replica, import_prefix
from cluster.serve.routing_options import RoutingOptions
from scheduler.kv_cache.transfer import HeldKeys
from scheduler.request import SamplingParams

logger = logging.getLogger(__name__)

RECENT_CAPACITY = 512
"""Finished requests a replica remembers for a hand-off (their token IDs only)."""
SHUTDOWN_MARGIN_S = 1.0
"""Kept free of the hand-off before Serve's force-kill deadline."""
DEFAULT_GRACEFUL_SHUTDOWN_S = 20.0
DEFAULT_WAIT_LOOP_S = 2.0


@dataclass(frozen=True)
class HandoffPrefix:
    """A conversation as its latest turn left it in the cache."""

    token_ids: tuple[int, ...]
    """The turn's prompt and answer."""
    prompt_len: int
    """The prompt's tokens: a recurrent state is handed off at its end too (a chat template
    may leave the generation prompt or the reasoning out of the next turn's history, which
    then leaves the answer before its end: the state at the answer's end would not serve)."""
    cache_salt: str | None


@dataclass(frozen=True)
class HandoffOptions:
    """When and how much a stopped replica hands off (from the router's kwargs)."""

    min_tokens: int
    """Only a prefix whose cached hit exceeds this is handed off (pull_threshold_tokens)."""
    max_prefixes: int
    """At most this many prefixes, the most recently used first."""
    pull_timeout_s: float
    """Deadline of one peer's pull."""

    @classmethod
    def from_router_kwargs(cls, kwargs: Mapping[str, Any]) -> HandoffOptions | None:
        """The hand-off with these `HybridPrefixRouter` request_router_kwargs (None: off, or
        pulls are off)."""
        known = {field.name for field in fields(RoutingOptions)}
        options = RoutingOptions(**{key: value for key, value in kwargs.items() if key in known})
        threshold = options.pull_threshold_tokens
        if options.drain_handoff_prefixes == 0 or threshold is None:
            return None
        return cls(threshold, options.drain_handoff_prefixes, options.pull_timeout_s)


def handoff_options(deployment_config: Mapping[str, Any]) -> HandoffOptions | None:
    """A model deployment's hand-off: on where `HybridPrefixRouter` routes it, unless its
    kwargs turn it (or pulls) off."""
    if not kv_events_enabled(deployment_config):
        return None
    router = deployment_config.get("request_router_config") or {}
    return HandoffOptions.from_router_kwargs(router.get("request_router_kwargs") or {})


def remembered(
    handoff: DrainHandoff | None, stream: AsyncIterator[RequestOutput], request: EngineRequest
) -> AsyncIterator[RequestOutput]:
    """The request's engine stream, its tokens remembered for a hand-off when there is one."""
    return stream if handoff is None else handoff.watch(stream, request)


class RecentPrefixes:
    """The token IDs of a replica's most recently finished requests, least recent first."""

    def __init__(self, capacity: int = RECENT_CAPACITY) -> None:
        self._entries: OrderedDict[HandoffPrefix, None] = OrderedDict()
        self._capacity = capacity

    def record(self, entry: HandoffPrefix) -> None:
        self._entries[entry] = None
        self._entries.move_to_end(entry)
        if len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def latest(self, limit: int, block_size: int) -> list[HandoffPrefix]:
        """Up to `limit` prefixes, most recent first, skipping one that a more recent one
        continues (an earlier turn of the same conversation)."""
        chosen: list[HandoffPrefix] = []
        for entry in reversed(self._entries):
            if len(chosen) >= limit:
                break
            if not any(_continues(k.token_ids, entry.token_ids, block_size) for k in chosen):
                chosen.append(entry)
        return chosen


def _continues(later: Sequence[int], earlier: Sequence[int], block_size: int) -> bool:
    """Whether `later` shares all but the last block of `earlier`."""
    common = 0
    for a, b in zip(later, earlier, strict=False):
        if a != b:
            break
        common += 1
    return common >= len(earlier) - block_size


def cached_prefix_tokens(core: EngineCore, token_ids: Sequence[int], cache_salt: str | None) -> int:
    """This engine's prefix-cache hit on the tokens (never the last one), state checkpoints
    included: what its scheduler would resume from, and what an export sends."""
    probe = prompt_probe(core, token_ids, cache_salt)
    return core.scheduler.kv_cache_manager.get_computed_blocks(probe).num_tokens


def publish_kv_events(core: EngineCore) -> None:
    """Put the prefix-cache keys stored since the last step in the event log the routers read
    (the engine does so after each step)."""
    core._record_kv_events()


class DrainHandoff:
    """One replica's side of the hand-off: it remembers, hands off once, and takes peers'."""

    def __init__(self, engine: AsyncEngine, options: HandoffOptions) -> None:
        self.engine = engine
        self.options = options
        self.recent = RecentPrefixes()
        self.started = False
        """True once this replica began handing off (it then refuses peers' hand-offs)."""

    async def watch(
        self, stream: AsyncIterator[RequestOutput], request: EngineRequest
    ) -> AsyncIterator[RequestOutput]:
        """The engine stream, passed through; a finished request's prompt + output tokens are
        remembered."""
        output_ids: list[int] = []
        try:
            async for delta in stream:
                if delta.outputs:
                    output_ids.extend(delta.outputs[0].token_ids)
                if delta.finished:
                    tokens = (*request.prompt_token_ids, *output_ids)
                    prompt_len = len(request.prompt_token_ids)
                    self.recent.record(HandoffPrefix(tokens, prompt_len, request.cache_salt))
                yield delta
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def accept(self, source: str, prefix: HandoffPrefix) -> bool:
        """A stopped peer's hand-off: pull the prefix from it, to the prompt's end, then to
        the answer's (True when both were imported). RuntimeError when this replica is handing
        off itself."""
        if self.started:
            raise RuntimeError("this replica is being stopped too")
        for end in sorted({prefix.prompt_len, len(prefix.token_ids)}):
            if not await self._pull(source, prefix.token_ids[:end], prefix.cache_salt):
                return False
        self.recent.record(prefix)
        await self.engine.call_core(publish_kv_events)  # an idle engine runs no step to do it
        return True

    async def _pull(self, source: str, token_ids: tuple[int, ...], cache_salt: str | None) -> bool:
        request = EngineRequest(
            request_id=f"handoff-{uuid.uuid4().hex}",
            prompt_token_ids=token_ids,
            sampling_params=SamplingParams(max_tokens=1),
            cache_salt=cache_salt,
        )
        replica = ReplicaID(source, serve.get_replica_context().replica_id.deployment_id)

        def export(
            prompt: list[int], held: HeldKeys, salt: str | None, timeout_s: float
        ) -> ReplicaCall:
            return call_replica(replica, "kv_export", prompt, held, salt, timeout_s)

        label = f"hand-off from {source}"
        timeout_s = self.options.pull_timeout_s
        return await import_prefix(self.engine, request, export, timeout_s, label) is not None

    def is_due(self) -> bool:
        """Whether Serve's stop should hand off first (once, and on an event loop: Serve awaits
        the destructor there; a plain call elsewhere just stops)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return not self.started

    async def run_then(self, stop: Callable[[], None]) -> None:
        """Hand off, then `stop` (the engine), whatever the hand-off did."""
        try:
            await self.run()
        finally:
            stop()

    async def run(self) -> int:
        """Hand the recent prefixes to the peers within the shutdown budget; the number
        handed off."""
        self.started = True
        started = time.monotonic()
        try:
            return await asyncio.wait_for(self._hand_off(), _budget_s())
        except asyncio.TimeoutError:
            logger.warning("drain hand-off: out of time; the rest is recomputed on the peers")
            return 0
        finally:
            logger.info("drain hand-off took %.2fs", time.monotonic() - started)

    async def _hand_off(self) -> int:
        prefixes = await self._worth_pulling()
        peers = _peer_replicas()
        if not prefixes or not peers:
            logger.info("drain hand-off: %d prefixes, %d peers", len(prefixes), len(peers))
            return 0
        pending = list(prefixes)
        num_done = 0
        for offset in range(len(peers)):  # a refused prefix goes to the next peer
            targets = [peers[(i + offset) % len(peers)] for i in range(len(pending))]
            done = await asyncio.gather(
                *(self._ask(peer, prefix) for peer, prefix in zip(targets, pending, strict=True))
            )
            num_done += sum(done)
            pending = [prefix for prefix, ok in zip(pending, done, strict=True) if not ok]
            if not pending:
                break
        logger.info("drain hand-off: %d of %d prefixes pulled by peers", num_done, len(prefixes))
        return num_done

    async def _worth_pulling(self) -> list[HandoffPrefix]:
        """The most recent prefixes whose cached hit here exceeds the pull threshold."""
        block_size = max(self.engine.core.scheduler.kv_cache_config.block_sizes)
        kept = []
        for entry in self.recent.latest(self.options.max_prefixes, block_size):
            hit = await self.engine.call_core(
                cached_prefix_tokens, entry.token_ids, entry.cache_salt
            )
            if hit > self.options.min_tokens:
                kept.append(entry)
        return kept

    async def _ask(self, peer: ReplicaID, prefix: HandoffPrefix) -> bool:
        source = serve.get_replica_context().replica_id.unique_id
        try:
            call = call_replica(peer, "accept_handoff", source, prefix)
            return bool(await asyncio.wait_for(_result(call), 2 * self.options.pull_timeout_s))
        except (asyncio.TimeoutError, ray.exceptions.RayError, ValueError, RuntimeError) as exc:
            logger.info("drain hand-off to %s refused: %s", peer.unique_id, exc)
            return False


async def _result(call: ReplicaCall) -> object:
    return await call


def _peer_replicas() -> list[ReplicaID]:
    """The other live replicas of this replica's deployment (Serve names each replica actor
    after its ID in its namespace), in a stable order."""
    own = serve.get_replica_context().replica_id
    prefix = own.to_full_id_str().rsplit("#", 1)[0] + "#"
    names = ray.util.list_named_actors(all_namespaces=True)
    peers = []
    for entry in names:
        name = entry["name"]
        if entry["namespace"] == SERVE_NAMESPACE and name.startswith(prefix):
            unique_id = name[len(prefix) :]
            if unique_id != own.unique_id:
                peers.append(ReplicaID(unique_id, own.deployment_id))
    return sorted(peers, key=lambda replica: replica.unique_id)


def _budget_s() -> float:
    """What is left of Serve's graceful_shutdown_timeout_s after one drain loop."""
    config = getattr(serve.get_replica_context(), "_deployment_config", None)
    timeout_s = getattr(config, "graceful_shutdown_timeout_s", DEFAULT_GRACEFUL_SHUTDOWN_S)
    wait_loop_s = getattr(config, "graceful_shutdown_wait_loop_s", DEFAULT_WAIT_LOOP_S)
    return max(SHUTDOWN_MARGIN_S, timeout_s - wait_loop_s - SHUTDOWN_MARGIN_S)

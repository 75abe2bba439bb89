"""A conversation's prefix pulled from the peer replica that caches it (Serve, one deployment).

    router: request sent away from the replica predicted to hold its prefix (load, a replica out
            of routing), the prefix leading the receiver's own predicted hit by
            >= pull_threshold_tokens ─► PeerPull(source replica) travels with the request
    receiver (LLMServer.generate, before the engine): its held keys ─► .kv_export(prompt,
            held) called on the source's replica actor itself (`call_replica`: routable or
            draining alike) ─► export (the pages, or the source's ranks' offers of them,
            each taken by the rank of its number here) ─► import here, within pull_timeout_s
    anything else (no hint, the source is this replica or gone, a late or failed export)
            ─► recompute

Only the blocks the receiver lacks travel (its held keys go with the export call). The call
does not go through Serve's routing: a replica that left it (scaled down, stopped) stays
reachable while Serve drains it, and the export counts as one of its ongoing requests, so the
drain waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve._private.common import RequestMetadata
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.request_router import ReplicaID

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import EngineDeadError
from cluster.engine.kv_transfer import KVImportResult, KVTransfer, import_within, kv_held_keys
from cluster.engine.request import EngineRequest
from scheduler.kv_cache.transfer import HeldKeys
from worker.deadlines import timeout_until

logger = logging.getLogger(__name__)

KV_SOURCE_KWARG = "kv_source"
"""The keyword under which the router hands the receiving replica a `PeerPull`."""
TO_REPLICA_KWARG = "to_replica"
"""The keyword of a call naming the replica the router must send it to (a replica's own
stats)."""


@dataclass(frozen=True)
class PeerPull:
    """Where a request's prefix is cached, as the router predicts it."""

    source: str
    """The Serve replica ID (`ReplicaID.unique_id`) of the replica holding the prefix."""
    num_tokens: int
    """The prefix tokens the source is predicted to hold."""
    timeout_s: float
    """Deadline of the whole pull; past it the receiver recomputes."""


async def pull_from_peer(engine: AsyncEngine, request: EngineRequest, pull: PeerPull) -> bool:
    """Pull `request`'s prefix from `pull.source` into this replica's engine; True when it was
    imported, False when the request recomputes (the source is this replica, or the export
    failed or missed the deadline)."""
    context = serve.get_replica_context()
    if context.replica_id.unique_id == pull.source:
        return False
    source = ReplicaID(pull.source, context.replica_id.deployment_id)

    def export(
        prompt: list[int], held: HeldKeys, cache_salt: str | None, timeout_s: float
    ) -> ReplicaCall:
        return call_replica(source, "kv_export", prompt, held, cache_salt, timeout_s)

    label = f"pull of {request.request_id} from {pull.source}"
    result = await import_prefix(engine, request, export, pull.timeout_s, label)
    if result is None:
        return False
    logger.debug(
        "pulled %d blocks of %s from %s", result.num_blocks, request.request_id, pull.source
    )
    return True


async def import_prefix(
    engine: AsyncEngine,
    request: EngineRequest,
    export: Callable[[list[int], HeldKeys, str | None, float], Any],
    timeout_s: float,
    label: str,
) -> KVImportResult | None:
    """Import into `engine` the blocks of `request`'s prefix it lacks, as the Serve call
    `export(prompt, held keys, cache_salt, timeout_s)` returns them (or offers them) within
    `timeout_s`; None (the request recomputes, counted and logged as `label`) when that call
    fails or misses the deadline."""
    counters = engine.core.kv_transfer_counters
    prompt = list(request.prompt_token_ids)
    response = None
    deadline = time.monotonic() + timeout_s
    counters.num_pulls_in_flight += 1
    try:
        held = await engine.call_core(kv_held_keys, prompt, request.cache_salt)
        response = export(prompt, held, request.cache_salt, timeout_s)
        sent = await asyncio.wait_for(_awaited(response), timeout_s)
        result = await import_within(engine, sent, timeout_until(deadline))
    except (asyncio.TimeoutError, RayError, RuntimeError, ValueError) as exc:
        if isinstance(exc, EngineDeadError):
            raise
        if response is not None:
            response.cancel()
        counters.num_recomputes += 1
        logger.warning("%s failed; recomputing: %s", label, exc)
        return None
    finally:
        counters.num_pulls_in_flight -= 1
    counters.num_pulls += 1
    return result


class ReplicaCall:
    """A user method's call on one replica actor: awaitable, and cancellable."""

    def __init__(self, ref: ray.ObjectRef[Any]) -> None:
        self.ref = ref

    def __await__(self) -> Generator[Any, None, Any]:
        return self.ref.__await__()

    def cancel(self) -> None:
        ray.cancel(self.ref)


def call_replica(replica: ReplicaID, method: str, *args: Any) -> ReplicaCall:
    """Call `method` of the replica's deployment on that replica's actor itself, whether
    Serve routes to it or drains it (a Serve replica actor is named after its ID in the
    "serve" namespace; the call enters it as Serve's own unary handle calls do, so it counts
    as an ongoing request there). ValueError when that actor is gone."""
    actor = _replica_actor(replica)
    request_id = uuid.uuid4().hex
    metadata = RequestMetadata(
        request_id, request_id, call_method=method, app_name=replica.deployment_id.app_name
    )
    return ReplicaCall(actor.handle_request.remote(pickle.dumps(metadata), *args))


def replica_is_alive(replica: ReplicaID) -> bool:
    """Whether the replica's actor still lives (routable, draining or not yet killed); asked
    once per replica, when it leaves routing."""
    try:
        _replica_actor(replica)
    except ValueError:
        return False
    return True


def _replica_actor(replica: ReplicaID) -> Any:
    """The replica's actor: named after its ID in Serve's namespace; ValueError once gone."""
    return ray.get_actor(replica.to_full_id_str(), namespace=SERVE_NAMESPACE)


async def _awaited(response: Any) -> KVTransfer:
    transfer: KVTransfer = await response
    return transfer

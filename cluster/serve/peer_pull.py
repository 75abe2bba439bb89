"""A conversation's prefix pulled from the peer replica that caches it (Serve, one deployment).

    router: request sent away from the replica predicted to hold its prefix (load, a replica out
            of routing), the prefix leading the receiver's own predicted hit by
            >= pull_threshold_tokens ─► PeerPull(source replica) travels with the request
    receiver (LLMServer.generate, before the engine): its held keys ─► its own deployment's
            handle .kv_export(prompt, held, to_replica=source) ─► the router sends that
            call to the source replica ─► export ─► import here, within pull_timeout_s
    anything else (no hint, the source is this replica, a late or failed export) ─► recompute

Only the blocks the receiver lacks travel (its held keys go with the export call).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.exceptions import RayError

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.errors import EngineDeadError
from cluster.engine.kv_transfer import KVImportResult, kv_held_keys, kv_import
from cluster.engine.request import EngineRequest

logger = logging.getLogger(__name__)

KV_SOURCE_KWARG = "kv_source"
"""The keyword under which the router hands the receiving replica a `PeerPull`."""
TO_REPLICA_KWARG = "to_replica"
"""The keyword of a call naming the replica the router must send it to (a pull's export, a
replica's own stats)."""


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
    counters = engine.core.kv_transfer_counters
    prompt = list(request.prompt_token_ids)
    response = None
    try:
        held = await engine.call_core(kv_held_keys, prompt, request.cache_salt)
        handle: Any = serve.get_deployment_handle(context.deployment, context.app_name)
        response = handle.kv_export.remote(
            prompt, held, request.cache_salt, **{TO_REPLICA_KWARG: pull.source}
        )
        transfer = await asyncio.wait_for(_awaited(response), pull.timeout_s)
        result: KVImportResult = await engine.call_core(kv_import, transfer)
    except (asyncio.TimeoutError, RayError, RuntimeError, ValueError) as exc:
        if isinstance(exc, EngineDeadError):
            raise
        if response is not None:
            response.cancel()
        counters.num_recomputes += 1
        logger.warning(
            "pull of %s from %s failed; recomputing: %s", request.request_id, pull.source, exc
        )
        return False
    counters.num_pulls += 1
    logger.debug(
        "pulled %d blocks of %s from %s", result.num_blocks, request.request_id, pull.source
    )
    return True


async def _awaited(response: Any) -> Any:
    return await response

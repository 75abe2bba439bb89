"""What a `HybridPrefixRouter` of this process knows, and waiting until it has heard the replicas.

Serve's controller polls each replica's routing stats (KV events, loaded LoRA adapters) and hands
them to every router of the deployment at once, this process's and the ingress's alike. A test
waits until this process's router holds every replica's events up to what the replica has
logged now (asked of the replica itself), instead of sleeping a few stats periods.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.serve.request_router import ReplicaID

from cluster.serve.hybrid_router import KV_EVENTS_STAT, LORA_ADAPTERS_STAT
from cluster.serve.peer_pull import call_replica
from tests.helpers.waiting import wait_until


def local_router(handle: Any) -> Any:
    """The `HybridPrefixRouter` behind a deployment handle of this process (made by the
    handle's first request)."""
    return handle._router._asyncio_router.request_router


def replica_routing_stats(replica: ReplicaID) -> dict[str, Any]:
    """The routing stats the replica itself reports now (`LLMServer.record_routing_stats`)."""
    stats: dict[str, Any] = ray.get(call_replica(replica, "record_routing_stats").ref, timeout=30)
    return stats


def loaded_adapters(router: Any) -> dict[ReplicaID, tuple[str, ...]]:
    """The LoRA adapters each of the router's replicas has loaded, as the replica says."""
    return {
        replica: tuple(replica_routing_stats(replica).get(LORA_ADAPTERS_STAT, ()))
        for replica in router.curr_replicas
    }


def has_heard_every_replica(router: Any) -> bool:
    """Whether the router holds each replica's KV events up to the replica's latest batch."""
    for replica, running in router.curr_replicas.items():
        logged = replica_routing_stats(replica)[KV_EVENTS_STAT].next_seq
        heard = (running.routing_stats or {}).get(KV_EVENTS_STAT)
        if heard is None or heard.next_seq < logged:
            return False
    return True


def wait_until_heard(router: Any, what: str = "the replicas' events reach the router") -> None:
    """Until the router holds what every replica has logged by now."""
    wait_until(lambda: has_heard_every_replica(router), what)

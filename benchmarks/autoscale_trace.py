"""The Mamba-heavy trace of the autoscaling benchmark: a handful of long concurrent requests on a
tiny Mamba hybrid whose pool holds few state slots, sent to two apps at once: one autoscaled by
Serve's default policy (ongoing requests against `target_ongoing_requests`), one by the hybrid
policy (the fullest KV cache group, waiting requests). The requests are far fewer than the
ongoing-requests target, so only a policy that sees the state slots fill scales up."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve._private.common import ReplicaID

from benchmarks.autoscale_load import LoadShape, Ramp, one_turn, replica_counts
from cluster.config.autoscaling import HYBRID_POLICY, hybrid_policy_settings
from cluster.serve import build_llm_deployment, deployment_name
from cluster.serve.autoscaling_decision import (
    KV_PRESSURE_PREFIX,
    NUM_WAITING,
    DeploymentLoad,
    ReplicaLoad,
    decide,
)
from cluster.serve.peer_pull import call_replica

MODEL = "tiny-hybrid"
NUM_REQUESTS = 8
"""Long requests in flight at once (closed loop): above the state slots, below the target."""
TRACE_S = 60.0
ENGINE = {"max_num_seqs": 64, "kv_cache_memory_bytes": 96 << 10, "block_size": None}
"""A pool of 24 blocks, attention blocks as large as a state (16 tokens, the hybrid default): a
request of about 30 tokens holds 2 attention blocks and 6 state blocks (2 in each of the 3 Mamba
layers' groups), so 3 requests run at once, the state slots full."""
LONG = LoadShape(MODEL, max_tokens=20, think_s=(0.0, 0.0))
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "initial_replicas": 1,
    "target_ongoing_requests": 16,
    "upscale_delay_s": 3,
    "downscale_delay_s": 60,
    "look_back_period_s": 2,
    "metrics_interval_s": 0.5,
}
HYBRID: dict[str, Any] = {
    "policy_function": HYBRID_POLICY,
    "policy_kwargs": {"metrics": ["kv_pressure", "queue_len"], "target_queue_len": 1},
}

ModelConfig = Callable[[Path, dict[str, Any], dict[str, Any]], dict[str, Any]]


def trace_app(model_dir: Path, model_config: ModelConfig, hybrid: bool) -> Any:
    autoscaling = {**AUTOSCALING, **({"policy": HYBRID} if hybrid else {})}
    deployment = {"autoscaling_config": autoscaling, "max_ongoing_requests": 32}
    return build_llm_deployment(model_config(model_dir, deployment, ENGINE))


async def _closed_loop(ramp: Ramp, app: str, until: float) -> None:
    async def one(slot: int) -> None:
        number = 0
        while time.monotonic() < until:
            words = " ".join(f"t{(11 * slot + 5 * number + i) % 200 + 20}" for i in range(6))
            turn, _, _ = await one_turn(
                ramp, [{"role": "user", "content": words}], f"{app}-{slot}-{number}", 0
            )
            ramp.turns.append(turn)
            number += 1

    async def poll() -> None:
        while True:
            running, wanted = await asyncio.to_thread(replica_counts, app, deployment_name(MODEL))
            ramp.replicas.append((ramp.now(), running, wanted))
            await asyncio.sleep(1.0)

    poller = asyncio.create_task(poll())
    await asyncio.gather(*(one(slot) for slot in range(NUM_REQUESTS)), _sample_loads(app, until))
    poller.cancel()


LOADS: dict[str, list[dict[str, float]]] = {}
"""What each app's replicas reported to the autoscaler, sampled during the trace."""


async def _sample_loads(app: str, until: float) -> None:
    """Each replica's autoscaling report, every 2 s (called on the replica actors)."""
    while time.monotonic() + 2 < until:
        await asyncio.sleep(2.0)
        for replica in _replicas(app):
            try:
                report = await call_replica(replica, "record_autoscaling_stats")
            except ray.exceptions.RayError:  # a replica still starting, or stopping
                continue
            LOADS.setdefault(app, []).append(report)


def _replicas(app: str) -> list[ReplicaID]:
    prefix = f"SERVE_REPLICA::{app}#"
    names = ray.util.list_named_actors(all_namespaces=True)
    return [ReplicaID.from_full_id_str(n["name"]) for n in names if n["name"].startswith(prefix)]


def bottleneck(app: str) -> str:
    """The single replica's first reports (the first 6 s), on average: the fullest KV cache
    group, the waiting requests, and what the hybrid policy decides on them."""
    reports = LOADS.get(app, [])[:3]
    if not reports:
        return "no report"
    sums: dict[str, float] = {}
    for report in reports:
        for name, value in report.items():
            sums[name] = sums.get(name, 0.0) + value
    means = {name: total / len(reports) for name, total in sums.items()}
    groups = {
        k.removeprefix(KV_PRESSURE_PREFIX): v
        for k, v in means.items()
        if k.startswith(KV_PRESSURE_PREFIX)
    }
    fullest = max(groups, key=groups.__getitem__) if groups else "none"
    shown = ", ".join(f"{k} {v:.2f}" for k, v in groups.items())
    waiting = means.get(NUM_WAITING, 0.0)
    load = DeploymentLoad(1, 1, 2, (ReplicaLoad.from_metrics(means),), NUM_REQUESTS, 16)
    decision = decide(load, hybrid_policy_settings(HYBRID["policy_kwargs"]))
    return (
        f"fullest group {fullest} (pressure {shown}); waiting {waiting:.1f}; hybrid policy: "
        f"{decision.num_replicas} replicas, driven by {decision.signal} ({decision.reason}; "
        f"{dict(decision.wanted)})"
    )


async def _both(ramps: dict[str, Ramp]) -> None:
    until = time.monotonic() + TRACE_S
    await asyncio.gather(*(_closed_loop(ramp, app, until) for app, ramp in ramps.items()))


def mamba_trace(model_dir: Path, model_config: ModelConfig) -> list[str]:
    """Run the trace on both apps at once; one report line per app."""
    ramps = {}
    for app, hybrid in (("mamba-serve-default", False), ("mamba-hybrid", True)):
        serve.run(trace_app(model_dir, model_config, hybrid), name=app, route_prefix=None)
        handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=app)
        ramps[app] = Ramp(handle, LONG)
    asyncio.run(_both(ramps))
    lines = [f"Mamba-heavy trace: {NUM_REQUESTS} long requests in flight, {TRACE_S:.0f} s"]
    for app, ramp in ramps.items():
        failed = sum(turn.error is not None for turn in ramp.turns)
        most = max((running for _, running, _ in ramp.replicas), default=0)
        asked = next((at for at, _, wanted in ramp.replicas if wanted > 1), None)
        up = next((at for at, running, _ in ramp.replicas if running > 1), None)
        when = "never scaled" if asked is None else f"a 2nd replica started at {asked:.0f} s"
        if up is not None:
            when += f", running at {up:.0f} s"
        lines.append(
            f"  {app}: max {most} replica(s) running ({when}), {len(ramp.turns)} requests, "
            f"{failed} failed; replicas report: {bottleneck(app)}"
        )
        serve.delete(app)
    return lines

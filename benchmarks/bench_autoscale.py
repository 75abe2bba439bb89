"""Autoscaling on real Ray Serve under a load ramp, on loopback Ray nodes (a head on 127.0.0.2,
worker nodes on 127.0.0.3 and .4), with tiny random models (no downloads).

1. Ramp: 1 -> 32 -> 64 -> 8 -> 1 concurrent multi-turn conversations (shared system prompt) on a
   tiny Mamba hybrid behind `HybridPrefixRouter`, autoscaled 1..3 replicas by the hybrid policy,
   run twice: drain hand-off on, then off (`drain_handoff_prefixes: 0`). Reported: replica count
   over time, p50/p99 TTFT per phase, failed requests, and the history tokens the conversations
   recompute in the window after each downscale.
2. Mamba-heavy trace: a few long concurrent requests on a tiny Mamba hybrid with few state
   slots, two apps at once: Serve's default policy (ongoing requests) and the hybrid policy;
   reported: the replicas each reaches.

    .venv/bin/python benchmarks/bench_autoscale.py [--phase-seconds 10,25,25,30,15]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ray import serve
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.autoscale_load import LoadShape, Ramp, Turn, run_ramp  # noqa: E402
from benchmarks.autoscale_trace import mamba_trace  # noqa: E402
from cluster.config.autoscaling import HYBRID_POLICY  # noqa: E402
from cluster.serve import build_llm_deployment, deployment_name  # noqa: E402
from tests.helpers.ray_driver import driver  # noqa: E402
from tests.helpers.ray_nodes import HEAD_IP, ray_nodes  # noqa: E402
from tests.helpers.serve_app import free_port, save_word_tokenizer, shutdown_serve  # noqa: E402
from tests.helpers.tiny_hybrid import save_tiny_hybrid  # noqa: E402

MODEL = "tiny-hybrid"
CONCURRENCY = (1, 32, 64, 8, 1)
DOWNSCALE_WINDOW_S = 20.0
"""Turns started this long after a downscale count as after it."""
BLOCK_SIZE = 4
RAMP_AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 3,
    "initial_replicas": 1,
    "target_ongoing_requests": 2,
    "upscale_delay_s": 3,
    "downscale_delay_s": 8,
    "look_back_period_s": 2,
    "metrics_interval_s": 0.5,
    "policy": {
        "policy_function": HYBRID_POLICY,
        # TTFT on a loaded 2-core machine says nothing about capacity: pools and queue only
        "policy_kwargs": {"metrics": ["kv_pressure", "queue_len"], "target_queue_len": 4},
    },
}


def router_config(handoff: bool) -> dict[str, Any]:
    return {
        "request_router_class": "cluster.serve.routing:HybridPrefixRouter",
        "request_routing_stats_period_s": 0.5,
        "request_router_kwargs": {
            "pull_threshold_tokens": 32,  # tiny CPU model: conversations of ~50-200 tokens
            "drain_handoff_prefixes": 64 if handoff else 0,
        },
    }


def model_config(
    model_dir: Path, deployment: dict[str, Any], engine: dict[str, Any]
) -> dict[str, Any]:
    return {
        "model_loading_config": {"model_id": MODEL, "model_source": str(model_dir)},
        "engine_kwargs": {  # None: the engine's default
            key: value
            for key, value in {
                "dtype": "float32",
                "block_size": BLOCK_SIZE,
                "device": "cpu",
                "distributed_executor_backend": "uni",
                **engine,
            }.items()
            if value is not None
        },
        "placement_group_config": {"bundles": [{"CPU": 0.25}]},
        "deployment_config": {
            "ray_actor_options": {"num_cpus": 0.1},
            "graceful_shutdown_wait_loop_s": 0.5,
            "graceful_shutdown_timeout_s": 20,
            **deployment,
        },
        "log_engine_metrics": False,
    }


def ramp_app(model_dir: Path, handoff: bool) -> Any:
    deployment = {
        "autoscaling_config": RAMP_AUTOSCALING,
        "max_ongoing_requests": 48,
        "request_router_config": router_config(handoff),
    }
    engine = {"max_num_seqs": 32, "kv_cache_memory_bytes": 16 << 20}
    return build_llm_deployment(model_config(model_dir, deployment, engine))


def run_one_ramp(model_dir: Path, handoff: bool, phases: list[tuple[int, float]]) -> Ramp:
    app = f"ramp-{'on' if handoff else 'off'}"
    serve.run(ramp_app(model_dir, handoff), name=app, route_prefix=None)
    handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=app)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ramp = Ramp(handle, LoadShape(MODEL, block_size=BLOCK_SIZE), tokenizer)
    asyncio.run(run_ramp(ramp, phases, app, deployment_name(MODEL)))
    serve.delete(app)
    return ramp


def downscales(ramp: Ramp) -> list[float]:
    """When the running replicas decreased."""
    times = []
    for (_, before, _), (at, after, _) in zip(ramp.replicas, ramp.replicas[1:], strict=False):
        if after < before:
            times.append(at)
    return times


def recomputed_after_downscales(ramp: Ramp) -> tuple[int, int]:
    """(History tokens recomputed, history tokens) of the turns started within
    DOWNSCALE_WINDOW_S after a downscale (each turn once)."""
    events = downscales(ramp)
    after = [
        turn
        for turn in ramp.turns
        if turn.history_tokens and any(0 <= turn.started - t < DOWNSCALE_WINDOW_S for t in events)
    ]
    return sum(turn.recomputed for turn in after), sum(turn.history_tokens for turn in after)


def phase_of(ramp: Ramp, turn: Turn) -> int:
    index = 0
    for position, (start, _) in enumerate(ramp.phase_starts):
        if turn.started >= start:
            index = position
    return index


def ttft_lines(ramp: Ramp) -> list[str]:
    lines = []
    for index, (start, concurrency) in enumerate(ramp.phase_starts):
        ttfts = sorted(
            t.ttft_s for t in ramp.turns if phase_of(ramp, t) == index and t.ttft_s is not None
        )
        if not ttfts:
            continue
        p50 = statistics.median(ttfts)
        p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
        lines.append(
            f"  phase {index + 1} ({concurrency:>2} conv, from {start:5.1f}s): {len(ttfts):4d} "
            f"turns, TTFT p50 {p50 * 1e3:6.0f} ms p99 {p99 * 1e3:6.0f} ms"
        )
    return lines


def replica_timeline(ramp: Ramp) -> str:
    changes = []
    last = None
    for at, running, wanted in ramp.replicas:
        if (running, wanted) != last:
            changes.append(f"{at:.0f}s:{running}/{wanted}")
            last = (running, wanted)
    return " ".join(changes)


def report_ramp(name: str, ramp: Ramp) -> tuple[int, int]:
    failed = [t for t in ramp.turns if t.error is not None]
    recomputed, history = recomputed_after_downscales(ramp)
    print(f"ramp, drain hand-off {name}: {len(ramp.turns)} turns, {len(failed)} failed")
    print(f"  replicas (time:running/running+starting): {replica_timeline(ramp)}")
    print("\n".join(ttft_lines(ramp)))
    print(
        f"  downscales at {[round(t) for t in downscales(ramp)]} s; history tokens recomputed in "
        f"the {DOWNSCALE_WINDOW_S:.0f} s after: {recomputed} of {history}"
    )
    for turn in failed[:5]:
        print(f"  failed at {turn.started:.1f}s: {turn.error}")
    return recomputed, len(failed)


@contextlib.contextmanager
def loopback_cluster() -> Iterator[None]:
    nodes_dir = Path(tempfile.mkdtemp(prefix="bench-autoscale-"))
    with ray_nodes(nodes_dir, head_cpus=2, worker_cpus=2) as cluster, driver(cluster):
        serve.start(proxy_location="HeadOnly", http_options={"host": HEAD_IP, "port": free_port()})
        try:
            yield
        finally:
            shutdown_serve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-seconds", default="10,25,25,30,15")
    parser.add_argument("--skip-ramp", action="store_true")
    parser.add_argument("--skip-mamba", action="store_true")
    args = parser.parse_args()
    seconds = [float(s) for s in args.phase_seconds.split(",")]
    phases = list(zip(CONCURRENCY, seconds, strict=True))
    work = Path(tempfile.mkdtemp(prefix="bench-autoscale-model-"))
    save_tiny_hybrid("bamba", work)
    save_word_tokenizer(work)
    started = time.monotonic()
    with loopback_cluster():
        if not args.skip_ramp:
            on = report_ramp("on", run_one_ramp(work, True, phases))
            off = report_ramp("off", run_one_ramp(work, False, phases))
            ratio = on[0] / off[0] if off[0] else float("nan")
            print(
                f"recomputed after downscale, hand-off on / off: {on[0]} / {off[0]} = {ratio:.1%}"
            )
            print(f"failed requests: on {on[1]}, off {off[1]}")
        if not args.skip_mamba:
            print("\n".join(mamba_trace(work, model_config)))
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

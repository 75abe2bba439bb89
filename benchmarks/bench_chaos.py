"""A bounded chaos run against the OpenAI endpoint: N requests at concurrency C with random client
disconnects, random bad inputs (invalid JSON, bad parameters, unknown model, too-long prompt, ...)
and one worker (rank actor) killed partway through.

Starts a local Ray instance on 127.0.0.2 and the Serve app (a tiny random model by default,
`--model DIR` for a local one, `--default-model` for the embedded SmolLM2-135M-Instruct), then:

1. a baseline in the same run: the same number of requests, all good, no kill;
2. the chaos run (requests drawn from `--seed`);
3. the replica's state once the run is over (KV usage must come back to 0).

It prints one JSON line per phase and a last line with the invariants (5xx for bad input: 0,
requests hung: 0, KV in use after the run: 0, good requests failed other than by the kill: 0);
the exit status is 1 when one is broken.

    python benchmarks/bench_chaos.py [--requests 300] [--concurrency 16] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.chaos import ChaosPlan, ChaosReport, kill_a_rank, run_chaos, wait_until_idle
from tests.helpers.ray_local import NODE_IP, start_local_ray
from tests.helpers.serve_app import free_port, llm_config, save_tiny_served_model

MODEL_ID = "chaos"
APP = "chaos"


def _model_dir(args: argparse.Namespace) -> Path:
    if args.default_model:
        from worker.default_model import ensure_default_model

        return ensure_default_model()
    if args.model:
        return Path(args.model)
    return save_tiny_served_model(Path(tempfile.mkdtemp(prefix="bench-chaos-")))


def _serve(args: argparse.Namespace) -> str:
    """Start Ray and the app; the base URL."""
    from ray.serve.config import HTTPOptions

    from cluster.serve import build_openai_app

    config = llm_config(_model_dir(args), MODEL_ID, worker_step_timeout_s=args.step_timeout)
    if args.default_model or args.model:
        kv = {"block_size": 16, "kv_cache_memory_bytes": 256 << 20, "max_model_len": 2048}
        config["engine_kwargs"].update(kv)
    ingress = {"ray_actor_options": {"num_cpus": 0.25}}
    start_local_ray()
    port = free_port()
    serve.start(http_options=HTTPOptions(host=NODE_IP, port=port))
    app = build_openai_app({"llm_configs": [config], "ingress_deployment_config": ingress})
    serve.run(app, name=APP, route_prefix="/")
    return f"http://{NODE_IP}:{port}"


def _max_model_len(base_url: str) -> int:
    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    return int(next(card["max_model_len"] for card in models if card["id"] == MODEL_ID))


def _stats() -> dict[str, Any]:
    from cluster.serve import deployment_name

    handle = serve.get_deployment_handle(deployment_name(MODEL_ID), app_name=APP)
    stats: dict[str, Any] = handle.stats.remote().result()
    return stats


def _plan(args: argparse.Namespace) -> ChaosPlan:
    return ChaosPlan(
        num_requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        deadline_s=args.deadline,
        bad_fraction=args.bad_fraction,
        disconnect_fraction=args.disconnect_fraction,
        kill_at=args.kill_at,
        max_tokens=args.max_tokens,
    )


def _invariants(report: ChaosReport, after: dict[str, Any]) -> dict[str, bool]:
    return {
        "no_5xx_for_bad_input": report.bad_5xx == 0,
        "no_request_hung": report.hung == 0,
        "no_kv_in_use_after": after["kv_cache_usage"] == 0 and not after["num_running"],
        "good_failed_only_by_kill": report.good_failed_other == 0,
    }


async def _phases(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    plan, max_len = _plan(args), _max_model_len(base_url)
    calm = replace(plan, bad_fraction=0.0, disconnect_fraction=0.0)
    baseline = await run_chaos(base_url, MODEL_ID, max_len, calm, lambda: None)
    print(json.dumps({"baseline": baseline.as_dict()}), flush=True)
    killed: list[str] = []
    chaos = await run_chaos(base_url, MODEL_ID, max_len, plan, lambda: killed.append(kill_a_rank()))
    print(json.dumps({"chaos": chaos.as_dict(), "killed": killed}), flush=True)
    started = time.monotonic()
    after = await asyncio.to_thread(wait_until_idle, _stats)
    after["seconds_to_idle"] = round(time.monotonic() - started, 2)
    print(json.dumps({"after": after}), flush=True)
    ratios = {
        "good_p50_latency_vs_baseline": chaos.good_latency_p50_s / baseline.good_latency_p50_s,
        "run_seconds_vs_baseline": chaos.seconds / baseline.seconds,
    }
    return {"ratios": ratios, "invariants": _invariants(chaos, after), "killed": killed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds: later = hung")
    parser.add_argument("--bad-fraction", type=float, default=0.3)
    parser.add_argument("--disconnect-fraction", type=float, default=0.2)
    parser.add_argument("--kill-at", type=float, default=0.3, help="fraction of requests sent")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--step-timeout", type=float, default=30.0, help="worker_step_timeout_s")
    parser.add_argument("--model", default=None)
    parser.add_argument("--default-model", action="store_true")
    parser.add_argument("--json", default=None, help="also write the summary here")
    args = parser.parse_args()
    try:
        base_url = _serve(args)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # after Serve set up logging
        summary = asyncio.run(_phases(args, base_url))
    finally:
        serve.shutdown()
    print(json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    sys.exit(0 if all(summary["invariants"].values()) and summary["killed"] else 1)


if __name__ == "__main__":
    main()

"""Prefill/decode disaggregation against the one-pool app on real Serve, in the same run.

Starts a local Ray instance and Serve with two applications of the same model (a tiny random
model by default, `--model DIR` for a real one): `pool` (`build_openai_app`, one replica) and
`pd` (`build_pd_openai_app`: a prefill replica and a decode replica, the prompt's KV handed over
through Ray's object store). At each concurrency level both take the same streaming completions
(distinct prompts, `ignore_eos`), one after the other, and the run reports TTFT and inter-token
latency p50/p99 for each, and P/D's ratios to the pool's.

    python benchmarks/bench_pd.py [--concurrency 1,4,16] [--requests 32] [--prompt-len 256]
        [--max-tokens 32] [--model DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from ray import serve

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_load import http_stream, prompt_text, sweep_level

from tests.helpers.ray_local import NODE_IP, start_local_ray
from tests.helpers.serve_app import free_port, llm_config, save_tiny_served_model

MODEL_ID = "bench"
APPS = ("pool", "pd")
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def _setup(args: argparse.Namespace) -> str:
    from ray.serve.config import HTTPOptions

    from cluster.serve import build_openai_app, build_pd_openai_app

    if args.model:
        model_dir = Path(args.model)
    else:
        model_dir = save_tiny_served_model(Path(tempfile.mkdtemp(prefix="bench-pd-")))
    config = llm_config(model_dir, MODEL_ID, max_num_seqs=64, distributed_executor_backend="uni")
    if args.model:
        config["engine_kwargs"].update({"block_size": 16, "kv_cache_memory_bytes": 512 << 20})
    start_local_ray(num_cpus=8)  # logical: three model replicas and two ingresses
    port = free_port()
    serve.start(http_options=HTTPOptions(host=NODE_IP, port=port))
    serve.run(build_openai_app({"llm_configs": [config]}), name="pool", route_prefix="/pool")
    pd = {"prefill_config": config, "decode_config": config, "kv_transfer_timeout_s": 60}
    serve.run(build_pd_openai_app(pd), name="pd", route_prefix="/pd")
    return f"http://{NODE_IP}:{port}"


async def _level(base: str, args: argparse.Namespace, level: int) -> dict[str, Any]:
    """Both apps at one concurrency level; fresh prompts per app and level (no cache hits)."""
    results: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=300) as client:
        for offset, app in enumerate(APPS):
            url = f"{base}/{app}/v1/completions"
            first = (2 * level + offset) * args.requests

            async def one(index: int, url: str = url, first: int = first) -> Any:
                body = {
                    "model": MODEL_ID,
                    "prompt": prompt_text(first + index, args.prompt_len),
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                return await http_stream(client, url, body)

            results[app] = await sweep_level(one, level, args.requests)
    results["pd_over_pool"] = {
        key: round(results["pd"][key] / results["pool"][key], 3) for key in METRICS
    }
    return results


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    base = _setup(args)
    async with httpx.AsyncClient(timeout=300) as client:  # warm both apps up
        for app in APPS:
            body = {"model": MODEL_ID, "prompt": prompt_text(10**6, 8), "max_tokens": 2}
            await http_stream(client, f"{base}/{app}/v1/completions", body)
    rows = []
    for level in args.concurrency:
        row = {"concurrency": level, **await _level(base, args, level)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| c | app | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for app in APPS:
            r = row[app]
            lines.append(
                f"| {row['concurrency']} | {app} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f}"
                f" | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['errors']} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=32, help="per app and level")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        rows = asyncio.run(_main(args))
    finally:
        serve.shutdown()
    print(_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Load generator for the OpenAI endpoint: both ingresses, both topologies, their floors, and the
engine direct.

Starts a local Ray instance and, side by side, the same model (a tiny random model by default,
`--model DIR` for a real one, `--default-model` for the embedded SmolLM2-135M-Instruct) served
in both topologies (`two_hop`: proxy -> ingress -> model deployment; `one_hop`: proxy -> the model
deployment serving the routes itself), plus an `AsyncEngine` in this process (the engine client
called directly, with the ingress's tokenization included). Each path is measured through both
HTTP ingresses (`--ingress both`, the default) of one Ray instance started in HAProxy mode:
`haproxy` (HAProxy straight to the ingress replicas: Serve's direct ingress) and `proxy` (Serve's
Python proxy; in HAProxy mode Serve runs it on the head as the fallback proxy, on a port of its
own, and it relays exactly as in proxy mode). Targets are named `<path>@<ingress>`. Then in one
run:

1. time to first token of one request at a time (`--repeats`, interleaved in rounds): HTTP
   through each topology, the two-hop model deployment's handle, the engine direct, and Ray
   Serve's own floors with no model: one hop (proxy -> a deployment streaming SSE lines at once;
   also with the request body read first, which costs the replica one more call to the proxy)
   and two hops (proxy -> a relaying ingress -> that deployment);
2. a concurrency sweep (streaming `/v1/completions`, `--concurrency`): TTFT, inter-token
   latency (per token: a chunk's gap split over its tokens) and the client-seen gap between
   chunks, p50/p99, tokens per chunk and output tokens/s for each topology (the adaptive stream
   batching default), for one hop with a fixed 50 ms interval (Ray Serve LLM's default), for
   each floor (the same number of one-token chunks, no model) and for the engine direct (no
   tokens held), measured back to back at each level, with the CPU seconds each process role
   spent on the level and per streamed request (`serve_cpu.py`: this process and the Ray
   instance it started, nothing else of the machine);
3. the goals as ratios of this run, per ingress: TTFT added over the engine direct vs the one-hop
   floor + 3 ms (that ingress's floor, the proxy's floor, and the body-reading floor),
   ITL p50 added at concurrency 1 (≤ 1 ms), output tokens/s at concurrency 64 vs the engine
   direct (≥ 0.9×; and the floors' tokens/s vs the engine direct: the most Serve and the HTTP
   client carry one chunk per token).

    python benchmarks/bench_serve.py [--concurrency 1,2,4,8,16,32,64,128] [--max-tokens 32]
        [--ingress both|haproxy|proxy] [--no-fixed-interval]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_cpu import cpu_by_role, snapshot
from serve_load import aiohttp_stream, engine_stream, http_stream, prompt_text, sweep_level

from cluster.cli.ingress_mode import HAPROXY, LOCALHOST, PROXY, set_mode_env
from tests.helpers.ray_local import NODE_IP, start_local_ray
from tests.helpers.serve_app import free_port, llm_config, save_tiny_served_model

MODEL_ID = "bench"
TOPOLOGIES = ("two_hop", "one_hop")
FIXED_INTERVAL_MS = 50.0
"""One hop with a fixed interval beside the adaptive default of the two topologies: every stream
flushes once per interval, whatever the load (Ray Serve LLM's default, `--fixed-interval-ms`)."""
FLOORS = {"one_hop": "floor1", "two_hop": "floor2"}
"""The apps that stream as many one-token chunks as asked for, with no model."""
FLOOR_LINE = 'data: {"choices": [{"text": "x"}]}\n\n'
FLOOR_MAX_ONGOING = 256  # the model deployments take as many: no queueing in front of a floor
RELAY_APP = FastAPI()
DIRECT_APP = FastAPI()


async def _floor_lines(count: int, interval_ms: float) -> Any:
    """`count` one-token completion chunks, `interval_ms` apart (the engine's pace; 0: at
    once), the usage chunk and `[DONE]`: our stream's shape with no model behind it."""
    for index in range(count):
        if index and interval_ms:
            await asyncio.sleep(interval_ms / 1000)
        yield FLOOR_LINE
    usage = {"choices": [], "usage": {"completion_tokens": count}}
    yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n"


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=FLOOR_MAX_ONGOING)
class FloorAnswer:
    """Streams `count` completion chunks at once: the model replica with no model."""

    async def generate(self, count: int, interval_ms: float) -> Any:
        async for line in _floor_lines(count, interval_ms):
            yield line


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=FLOOR_MAX_ONGOING)
@serve.ingress(RELAY_APP)
class FloorRelay:
    """Peeks the first line of the answer's stream and relays the rest, as our ingress does."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    @RELAY_APP.post("/v1/completions")
    async def completions(self, tokens: int = 4, interval_ms: float = 0) -> StreamingResponse:
        stream = self.answer.options(stream=True).generate.remote(tokens, interval_ms)
        first = await stream.__anext__()

        async def relay() -> Any:
            yield first
            async for line in stream:
                yield line

        return StreamingResponse(relay(), media_type="text/event-stream")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=FLOOR_MAX_ONGOING)
@serve.ingress(DIRECT_APP)
class FloorDirect:
    """The one-hop floor: the deployment behind the proxy streams the lines itself. With
    `read_body`, it first reads and parses the JSON body, as any POST handler must: the replica
    fetches the body from the proxy with one more actor call (Serve's `receive_asgi_messages`)."""

    @DIRECT_APP.post("/v1/completions")
    async def completions(
        self, raw: Request, tokens: int = 4, interval_ms: float = 0, read_body: bool = False
    ) -> StreamingResponse:
        if read_body:
            # named through `Request` so that the class, pickled by value into the replica,
            # carries the name FastAPI needs to resolve the `raw` annotation
            json.loads(await Request.body(raw))
        return StreamingResponse(_floor_lines(tokens, interval_ms), media_type="text/event-stream")


def fixed_target(args: argparse.Namespace) -> str:
    """The one-hop app with a fixed interval, named by it (`one_hop_50ms`)."""
    return f"one_hop_{args.fixed_interval_ms:g}ms"


def served_targets(args: argparse.Namespace) -> tuple[str, ...]:
    return TOPOLOGIES if args.no_fixed_interval else (*TOPOLOGIES, fixed_target(args))


def floor_of(target: str) -> str:
    return FLOORS["two_hop" if target == "two_hop" else "one_hop"]


def ingresses(args: argparse.Namespace) -> tuple[str, ...]:
    return (HAPROXY, PROXY) if args.ingress == "both" else (args.ingress,)


def at(target: str, ingress: str) -> str:
    """A target's name through one ingress (`one_hop@haproxy`)."""
    return f"{target}@{ingress}"


def _body(index: int, args: argparse.Namespace, max_tokens: int | None = None) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "prompt": prompt_text(index, args.prompt_len),
        "max_tokens": max_tokens or args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


async def _ttft_http(base: str, body: dict[str, Any], repeats: int, query: str = "") -> list[float]:
    async with httpx.AsyncClient(timeout=60) as client:
        url = f"{base}/v1/completions{query}"
        samples = [await http_stream(client, url, body) for _ in range(repeats)]
    return [s.ttft for s in samples if s.ttft is not None]


async def _ttft_handle(body: dict[str, Any], repeats: int) -> list[float]:
    from cluster.openai_api.protocol import CompletionRequest
    from cluster.serve import deployment_name

    handle = serve.get_deployment_handle(deployment_name(MODEL_ID), app_name="two_hop")
    handle = handle.options(stream=True)
    result = []
    for index in range(repeats):
        request = CompletionRequest.model_validate({**body, "stream": True})
        start = time.perf_counter()
        stream = handle.generate.remote(request, f"handle-{index}-{start}")
        async for _chunk in stream:
            result.append(time.perf_counter() - start)
            break
        stream.cancel()
        await asyncio.sleep(0.05)
    return result


class DirectEngine:
    """The engine client called directly: an `AsyncEngine` in this process, requests made from
    OpenAI bodies as the model server makes them (tokenization and parameter mapping)."""

    def __init__(self, config: dict[str, Any]) -> None:
        from cluster.config import LLMConfig
        from cluster.engine.async_engine import AsyncEngine
        from cluster.engine.core import build_engine_core
        from cluster.engine.input_processor import InputProcessor
        from cluster.engine.stream_batching import StreamBatching
        from cluster.serve.llm_server import serving_engine_args

        args = serving_engine_args(LLMConfig.model_validate(config))
        self.engine = AsyncEngine(build_engine_core(args), StreamBatching(0))  # nothing held
        model = self.engine.core.model_config
        self.inputs = InputProcessor(
            self.engine.core.tokenizer, model.vocab_size, model.max_model_len, MODEL_ID
        )
        self.counter = 0

    def request(self, body: dict[str, Any]) -> Any:
        from cluster.engine.request import EngineRequest
        from cluster.openai_api.protocol import CompletionRequest

        prompt, params = self.inputs.openai(CompletionRequest.model_validate(body))
        self.counter += 1
        return EngineRequest(f"direct-{self.counter}", tuple(prompt.token_ids), params, prompt.text)

    async def ttft(self, body: dict[str, Any], repeats: int) -> list[float]:
        result = []
        for _ in range(repeats):
            start = time.perf_counter()  # the ingress's work included: tokenize, map, queue
            stream = await self.engine.add_request(self.request(body))
            async for _delta in stream:
                result.append(time.perf_counter() - start)
                break
            await stream.aclose()  # type: ignore[attr-defined]
        return result


def _setup(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, Any]]:
    from ray.serve.config import HTTPOptions

    from cluster.serve import build_openai_app

    if args.default_model:
        from worker.default_model import ensure_default_model

        model_dir = ensure_default_model()
    elif args.model:
        model_dir = Path(args.model)
    else:
        model_dir = save_tiny_served_model(Path(tempfile.mkdtemp(prefix="bench-serve-")))
    config = llm_config(model_dir, MODEL_ID, max_num_seqs=128)
    if args.default_model or args.model:
        config["engine_kwargs"].update({"block_size": 16, "kv_cache_memory_bytes": 512 << 20})
    uses_haproxy = HAPROXY in ingresses(args)
    if uses_haproxy:  # before Ray starts: its processes read it (the fallback proxy's port too)
        set_mode_env(HAPROXY)
    start_local_ray(num_cpus=16)  # logical: two model replicas, the engine direct, the floors
    port = free_port()
    # HAProxy reaches the replicas of its own node through 127.0.0.1
    host = LOCALHOST if uses_haproxy else NODE_IP
    serve.start(http_options=HTTPOptions(host=host, port=port))
    for topology in TOPOLOGIES:
        app = build_openai_app({"llm_configs": [config], "topology": topology})
        serve.run(app, name=topology, route_prefix=f"/{topology}")
    interval = {"stream_batching_interval_ms": args.fixed_interval_ms}
    fixed = {**config, "experimental_configs": interval}
    app = build_openai_app({"llm_configs": [fixed], "topology": "one_hop"})
    serve.run(app, name=fixed_target(args), route_prefix=f"/{fixed_target(args)}")
    serve.run(FloorRelay.bind(FloorAnswer.bind()), name="floor2", route_prefix="/floor2")
    serve.run(FloorDirect.bind(), name="floor1", route_prefix="/floor1")
    if not uses_haproxy:
        return {PROXY: f"http://{NODE_IP}:{port}"}, config
    fallback = os.environ["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"]
    bases = {HAPROXY: f"http://{host}:{port}", PROXY: f"http://{host}:{fallback}"}
    return {ingress: bases[ingress] for ingress in ingresses(args)}, config


def _http_ttft_paths(base: str, ingress: str, body: dict[str, Any]) -> dict[str, Any]:
    """The TTFT paths over HTTP through one ingress."""
    paths: dict[str, Any] = {
        at(f"http_{t}", ingress): (lambda t=t: _ttft_http(f"{base}/{t}", body, 5))
        for t in TOPOLOGIES
    }
    floor1, floor2 = f"{base}/floor1", f"{base}/floor2"
    paths[at("floor_one_hop", ingress)] = lambda: _ttft_http(floor1, body, 5)
    paths[at("floor_one_hop_body", ingress)] = lambda: _ttft_http(
        floor1, body, 5, "?read_body=true"
    )
    paths[at("floor_two_hop", ingress)] = lambda: _ttft_http(floor2, body, 5)
    return paths


async def _ttft_medians(
    bases: dict[str, str], direct: DirectEngine, args: argparse.Namespace
) -> dict[str, float]:
    """Median TTFT (ms) of one request at a time per path, sampled in interleaved rounds."""
    body = _body(1, args, max_tokens=4)
    paths: dict[str, Any] = {
        "handle": lambda: _ttft_handle(body, 5),
        "engine": lambda: direct.ttft(body, 5),
    }
    for ingress, base in bases.items():
        paths.update(_http_ttft_paths(base, ingress, body))
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for round_index in range(max(1, args.repeats // 5) + 1):
        for name, measure in paths.items():
            values = await measure()
            if round_index:  # the first round warms every path up
                samples[name] += values
    return {name: 1000 * statistics.median(values) for name, values in samples.items()}


async def _sweep(
    bases: dict[str, str], direct: DirectEngine, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each level, back to back: the engine direct, then through each ingress the floors paced
    at the engine direct's inter-token latency of that level and the served targets."""
    rows = []
    limits = httpx.Limits(max_connections=max(args.concurrency) + 8)
    connector = aiohttp.TCPConnector(limit=max(args.concurrency) + 8)
    timeout = aiohttp.ClientTimeout(total=600)
    async with (
        httpx.AsyncClient(timeout=600, limits=limits) as client,
        aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
    ):

        def over_http(target: str, ingress: str, engine_row: dict[str, Any]) -> Any:
            url = f"{bases[ingress]}/{target}/v1/completions"
            if target in FLOORS.values():  # as many chunks as the model, at the engine's pace
                url += f"?tokens={args.max_tokens}&interval_ms={engine_row['itl_p50_ms']:.2f}"
            if args.client == "aiohttp":
                return lambda i: aiohttp_stream(session, url, _body(i, args))
            return lambda i: http_stream(client, url, _body(i, args))

        def on_engine(i: int) -> Any:
            return engine_stream(direct.engine, lambda j: direct.request(_body(j, args)), i)

        for concurrency in args.concurrency:
            requests = max(args.requests, 2 * concurrency)
            engine_row: dict[str, Any] = {}
            targets = [("engine", "")] + [
                (target, ingress)
                for ingress in bases
                for target in (*sorted(set(FLOORS.values())), *served_targets(args))
            ]
            for target, ingress in targets:
                if target == "engine":
                    one_request = on_engine
                else:
                    one_request = over_http(target, ingress, engine_row)
                name = at(target, ingress) if ingress else target
                before = snapshot()
                row = {"target": name, **await sweep_level(one_request, concurrency, requests)}
                row["cpu_s"] = cpu_by_role(before, snapshot())
                row["cpu_ms_per_request"] = {
                    role: round(1000 * seconds / requests, 2)
                    for role, seconds in row["cpu_s"].items()
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                engine_row = engine_row or row
    return rows


def _goals(
    ttft: dict[str, float], sweep: list[dict[str, Any]], served: tuple[str, ...]
) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    ingresses_run = sorted({key.rsplit("@", 1)[1] for key in ttft if "@" in key})
    for ingress in ingresses_run:
        for topology in served:
            goals.update(_ttft_goals(ttft, topology, ingress))
            goals.update(_sweep_goals(sweep, topology, ingress))
    return goals


def _ttft_goals(ttft: dict[str, float], topology: str, ingress: str) -> dict[str, Any]:
    """TTFT added at concurrency 1 against the one-hop floor + 3 ms: this ingress's floor, the
    proxy's (the floor the goal was first set against) and the body-reading floor."""
    key = at(f"http_{topology}", ingress)
    if key not in ttft:
        return {}
    name = at(topology, ingress)
    added = ttft[key] - ttft["engine"]
    goals: dict[str, Any] = {f"{name}_ttft_added_ms": round(added, 2)}
    goals[f"{name}_ttft_goal_met"] = added <= ttft[at("floor_one_hop", ingress)] + 3
    if at("floor_one_hop", PROXY) in ttft:
        goals[f"{name}_ttft_goal_met_proxy_floor"] = added <= ttft[at("floor_one_hop", PROXY)] + 3
    body_floor = ttft[at("floor_one_hop_body", ingress)]
    goals[f"{name}_ttft_goal_met_body_floor"] = added <= body_floor + 3
    return goals


def _sweep_goals(sweep: list[dict[str, Any]], topology: str, ingress: str) -> dict[str, Any]:
    """ITL p50 added at concurrency 1 (<= 1 ms) and output tokens/s at 64 (>= 0.9x the engine
    direct), and the floor's tokens/s at 64 (the most Serve and the client carry, no model)."""

    def level(target: str, concurrency: int) -> dict[str, Any] | None:
        found = [r for r in sweep if r["target"] == target and r["concurrency"] == concurrency]
        return found[0] if found else None

    name = at(topology, ingress)
    goals: dict[str, Any] = {}
    low, low_engine = level(name, 1), level("engine", 1)
    if low and low_engine:
        added_itl = low["itl_p50_ms"] - low_engine["itl_p50_ms"]
        goals[f"{name}_itl_p50_added_ms"] = round(added_itl, 2)
        goals[f"{name}_itl_goal_met"] = added_itl <= 1
    high, high_engine = level(name, 64), level("engine", 64)
    high_floor = level(at(floor_of(topology), ingress), 64)
    if high and high_engine:
        ratio = high["output_tok_s"] / high_engine["output_tok_s"]
        goals[f"{name}_tok_s_ratio_c64"] = round(ratio, 3)
        goals[f"{name}_tok_s_goal_met"] = ratio >= 0.9
    if high_floor and high_engine:
        goals[f"{name}_floor_tok_s_ratio_c64"] = round(
            high_floor["output_tok_s"] / high_engine["output_tok_s"], 3
        )
    return goals


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    bases, config = _setup(args)
    direct = DirectEngine(config)
    try:
        ttft = await _ttft_medians(bases, direct, args)
        print(json.dumps({"ttft_median_ms": ttft}), flush=True)
        sweep = await _sweep(bases, direct, args)
    finally:
        await direct.engine.shutdown()
    goals = _goals(ttft, sweep, served_targets(args))
    print(json.dumps({"goals": goals}), flush=True)
    return {"ttft_median_ms": ttft, "sweep": sweep, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--requests", type=int, default=16, help="per level (at least 2x c)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30, help="single-request TTFT samples")
    parser.add_argument("--model", default=None)
    parser.add_argument("--default-model", action="store_true")
    parser.add_argument(
        "--fixed-interval-ms", type=float, default=FIXED_INTERVAL_MS, help="the fixed app's"
    )
    parser.add_argument(
        "--client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the sweep's HTTP client (aiohttp: less of the shared CPU than httpx)",
    )
    parser.add_argument(
        "--ingress",
        choices=("both", HAPROXY, PROXY),
        default="both",
        help="the HTTP ingresses measured (both: one Ray instance in HAProxy mode, the proxy "
        "measured as its fallback proxy)",
    )
    parser.add_argument(
        "--no-fixed-interval", action="store_true", help="leave out the fixed-interval app"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results = asyncio.run(_main(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    serve.shutdown()


if __name__ == "__main__":
    main()

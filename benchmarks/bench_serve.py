"""Load generator for the OpenAI endpoint: a concurrency sweep, and the TTFT the ingress adds.

Starts a local Ray instance and the Serve app (a tiny random model by default, `--model DIR` for
a real one, `--default-model` for the embedded SmolLM2-135M-Instruct), then:

1. sweeps concurrency (1 to 64 streaming `/v1/completions` clients): TTFT and inter-token latency
   (p50/p99), output tokens/s, errors;
2. in the same run, measures time to first token of one request at a time three ways: through
   HTTP (proxy + ingress + model replica), through the model deployment's handle (no HTTP, no
   ingress), and on an `AsyncEngine` in this process (the engine client called directly). The
   difference of medians is the latency the serving layers add;
3. Ray Serve's own floor for that topology: HTTP proxy -> a relaying ingress -> a deployment
   that streams the same SSE lines at once (no model), measured the same way.

    python benchmarks/bench_serve.py [--concurrency 1,4,16,64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from ray import serve
from starlette.responses import StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.ray_local import NODE_IP, start_local_ray
from tests.helpers.serve_app import free_port, llm_config, save_tiny_served_model

MODEL_ID = "bench"
APP = "bench"


FLOOR_APP = FastAPI()
FLOOR_LINE = 'data: {"choices": [{"text": "x"}]}\n\n'


@serve.deployment
class FloorAnswer:
    """Streams `count` completion chunks at once: the model replica with no model."""

    async def generate(self, count: int) -> Any:
        for _ in range(count):
            yield FLOOR_LINE


@serve.deployment
@serve.ingress(FLOOR_APP)
class FloorRelay:
    """Peeks the first line of the answer's stream and relays the rest, as our ingress does."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    @FLOOR_APP.post("/v1/completions")
    async def completions(self) -> StreamingResponse:
        stream = self.answer.options(stream=True).generate.remote(4)
        first = await stream.__anext__()

        async def relay() -> Any:
            yield first
            async for line in stream:
                yield line

        return StreamingResponse(relay(), media_type="text/event-stream")


@dataclass
class Sample:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _prompt(index: int, length: int) -> str:
    return " ".join(f"t{(index * 7 + i) % 250 + 1}" for i in range(length))


async def _one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    sample = Sample()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                sample.error = str(response.status_code)
                await response.aread()
                return sample
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if not chunk["choices"] or not chunk["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if sample.ttft is None:
                    sample.ttft = now - start
                else:
                    sample.itls.append(now - last)
                last = now
                sample.tokens += 1
    except httpx.HTTPError as error:
        sample.error = type(error).__name__
    return sample


async def _sweep_level(base: str, concurrency: int, requests: int, args: Any) -> dict[str, Any]:
    url = base + "/v1/completions"
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(index)
    samples: list[Sample] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            index = queue.get_nowait()
            body = {
                "model": MODEL_ID,
                "prompt": _prompt(index, args.prompt_len),
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            samples.append(await _one_stream(client, url, body))

    limits = httpx.Limits(max_connections=concurrency + 4)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    itls = [x for s in samples for x in s.itls]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "errors": sum(s.error is not None for s in samples),
        "ttft_p50_ms": 1000 * _pct(ttfts, 0.5),
        "ttft_p99_ms": 1000 * _pct(ttfts, 0.99),
        "itl_p50_ms": 1000 * _pct(itls, 0.5),
        "itl_p99_ms": 1000 * _pct(itls, 0.99),
        "output_tok_s": sum(s.tokens for s in samples) / elapsed,
    }


async def _ttft_http(base: str, body: dict[str, Any], repeats: int) -> list[float]:
    async with httpx.AsyncClient(timeout=60) as client:
        url = base + "/v1/completions"
        samples = [await _one_stream(client, url, body) for _ in range(repeats)]
    return [s.ttft for s in samples if s.ttft is not None]


async def _ttft_handle(body: dict[str, Any], repeats: int) -> list[float]:

    from cluster.openai_api.protocol import CompletionRequest
    from cluster.serve import deployment_name

    handle = serve.get_deployment_handle(deployment_name(MODEL_ID), app_name=APP)
    handle = handle.options(stream=True)
    result = []
    for index in range(repeats):
        request = CompletionRequest.model_validate(body)
        start = time.perf_counter()
        stream = handle.generate.remote(request, f"handle-{index}")
        async for _chunk in stream:
            result.append(time.perf_counter() - start)
            break
        stream.cancel()
        await asyncio.sleep(0.05)
    return result


async def _ttft_engine(config: dict[str, Any], body: dict[str, Any], repeats: int) -> list[float]:
    from cluster.config import LLMConfig
    from cluster.engine.async_engine import AsyncEngine
    from cluster.engine.core import build_engine_core
    from cluster.engine.input_processor import InputProcessor
    from cluster.engine.request import EngineRequest
    from cluster.openai_api.protocol import CompletionRequest
    from cluster.serve.llm_server import serving_engine_args

    engine = AsyncEngine(build_engine_core(serving_engine_args(LLMConfig.model_validate(config))))
    request = CompletionRequest.model_validate(body)
    model = engine.core.model_config
    inputs = InputProcessor(engine.core.tokenizer, model.vocab_size, model.max_model_len, "bench")
    result = []
    try:
        for index in range(repeats):
            start = time.perf_counter()  # the ingress's work included: tokenize, map, queue
            prompt, params = inputs.openai(request)
            stream = await engine.add_request(
                EngineRequest(f"direct-{index}", tuple(prompt.token_ids), params, prompt.text)
            )
            async for _delta in stream:
                result.append(time.perf_counter() - start)
                break
            await stream.aclose()  # type: ignore[attr-defined]
    finally:
        await engine.shutdown()
    return result


def _setup(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
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
    config["deployment_config"]["ray_actor_options"] = {"num_cpus": 1}
    start_local_ray()
    port = free_port()
    serve.start(http_options=HTTPOptions(host=NODE_IP, port=port))
    serve.run(build_openai_app({"llm_configs": [config]}), name=APP, route_prefix="/")
    serve.run(FloorRelay.bind(FloorAnswer.bind()), name="floor", route_prefix="/floor")
    return f"http://{NODE_IP}:{port}", config


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    base, config = _setup(args)
    body = {
        "model": MODEL_ID,
        "prompt": _prompt(1, args.prompt_len),
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    await _ttft_http(base, body, 5)  # warm-up
    sweep = []
    for concurrency in args.concurrency:
        requests = max(args.requests, 2 * concurrency)
        sweep.append(await _sweep_level(base, concurrency, requests, args))
        print(json.dumps(sweep[-1]), flush=True)
    http = await _ttft_http(base, body, args.repeats)
    handle = await _ttft_handle(body, args.repeats)
    direct = await _ttft_engine(config, body, args.repeats)
    await _ttft_http(base + "/floor", body, 5)  # warm-up
    floor = await _ttft_http(base + "/floor", body, args.repeats)
    medians = {
        "http_ms": 1000 * statistics.median(http),
        "handle_ms": 1000 * statistics.median(handle),
        "engine_ms": 1000 * statistics.median(direct),
        "serve_floor_ms": 1000 * statistics.median(floor),
    }
    medians["ingress_adds_ms"] = medians["http_ms"] - medians["engine_ms"]
    print(json.dumps({"ttft_median": medians}), flush=True)
    return {"sweep": sweep, "ttft_median": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    parser.add_argument("--requests", type=int, default=16, help="per level (at least 2x c)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=30, help="single-request TTFT samples")
    parser.add_argument("--model", default=None)
    parser.add_argument("--default-model", action="store_true")
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

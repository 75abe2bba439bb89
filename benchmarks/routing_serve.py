"""The short real-Serve part of the routing benchmark: two CPU replicas of a tiny sliding-window
hybrid (gemma3 layout) on a local loopback Ray, multi-turn chat sessions over HTTP, one app per
router in turn; the prefix-cache hit rate is what the replicas report per response
(`usage.prompt_tokens_details.cached_tokens`).

Through each HTTP ingress asked for (`haproxy`, `proxy`): with HAProxy, Ray starts in HAProxy
mode and the proxy is the fallback proxy Serve runs beside it, so both are measured in one Ray
instance, a fresh app (cold caches) per router and ingress. A request router keeps the two-hop
topology, where the ingress replica runs it whatever carries the HTTP request."""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from ray import serve
from ray.serve.config import HTTPOptions

from cluster.cli.ingress_mode import HAPROXY, LOCALHOST, PROXY, set_mode_env
from cluster.serve import build_openai_app
from tests.helpers.ray_local import NODE_IP, start_local_ray
from tests.helpers.serve_app import free_port, save_word_tokenizer, shutdown_serve
from tests.helpers.tiny_models import save_tiny_model

SERVE_ROUTERS = {
    "Serve default (power of two)": None,
    "ray-prefix-affinity": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "hybrid-prefix (ours)": "cluster.serve.routing:HybridPrefixRouter",
}
MODEL = "tiny-hybrid"


def _app(model_dir: Path, router: str | None, kv_bytes: int) -> Any:
    deployment: dict[str, Any] = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}}
    if router is not None:
        deployment["request_router_config"] = {
            "request_router_class": router,
            "request_routing_stats_period_s": 0.5,
        }
    config = {
        "model_loading_config": {"model_id": MODEL, "model_source": str(model_dir)},
        "engine_kwargs": {
            "block_size": 4,
            "max_num_seqs": 16,
            "device": "cpu",
            "distributed_executor_backend": "uni",
            "kv_cache_memory_bytes": kv_bytes,
        },
        "placement_group_config": {"bundles": [{"CPU": 0.25}]},
        "deployment_config": deployment,
    }
    ingress = {"ray_actor_options": {"num_cpus": 0.1}}
    return build_openai_app({"llm_configs": [config], "ingress_deployment_config": ingress})


def _session(base_url: str, number: int, num_turns: int) -> list[tuple[int, int]]:
    """One chat session; (prompt tokens, cached tokens) per turn."""
    history: list[dict[str, str]] = []
    usage = []
    with httpx.Client(timeout=300) as client:
        for turn in range(num_turns):
            words = " ".join(f"t{(13 * number + 5 * turn + 3 * i) % 200 + 20}" for i in range(24))
            history.append({"role": "user", "content": words})
            body = {"model": MODEL, "messages": history, "max_tokens": 8, "temperature": 0}
            response = client.post(f"{base_url}/v1/chat/completions", json=body).json()
            answer = response["choices"][0]["message"]["content"]
            history.append({"role": "assistant", "content": answer})
            tokens = response["usage"]
            usage.append(
                (tokens["prompt_tokens"], tokens["prompt_tokens_details"]["cached_tokens"])
            )
            time.sleep(1.0)  # the user reads the answer
    return usage


def run_serve(
    num_sessions: int, num_turns: int, kv_bytes: int, ingresses: tuple[str, ...] = (PROXY,)
) -> list[str]:
    """One table row per router and ingress: hit rate over the turns after the first, and wall
    time."""
    if HAPROXY in ingresses:  # before Ray starts: its processes read it
        set_mode_env(HAPROXY)
    start_local_ray()
    port = free_port()
    host = LOCALHOST if HAPROXY in ingresses else NODE_IP
    serve.start(http_options=HTTPOptions(host=host, port=port))
    bases = {HAPROXY: f"http://{host}:{port}", PROXY: f"http://{host}:{port}"}
    if HAPROXY in ingresses:
        bases[PROXY] = f"http://{host}:{os.environ['RAY_SERVE_FALLBACK_PROXY_HTTP_PORT']}"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder)
        save_tiny_model("gemma3", model_dir, max_position_embeddings=512)
        save_word_tokenizer(model_dir)
        for name, router in SERVE_ROUTERS.items():
            for ingress in ingresses:
                serve.run(_app(model_dir, router, kv_bytes), name="bench", route_prefix="/")
                hit_rate, wall = _sessions(bases[ingress], num_sessions, num_turns)
                rows.append(
                    f"| {name} | {ingress} | {num_sessions} | {num_turns} | {hit_rate:.1%} "
                    f"| {wall:.0f} |"
                )
                serve.delete("bench")
    shutdown_serve()
    return rows


def _sessions(base_url: str, num_sessions: int, num_turns: int) -> tuple[float, float]:
    """The sessions run at once: hit rate of the turns after the first, and wall seconds."""
    began = time.perf_counter()
    with ThreadPoolExecutor(num_sessions) as pool:
        runs = [pool.submit(_session, base_url, n, num_turns) for n in range(num_sessions)]
        sessions = [run.result() for run in runs]
    wall = time.perf_counter() - began
    later = [turn for turns in sessions for turn in turns[1:]]
    prompt = sum(p for p, _ in later)
    cached = sum(c for _, c in later)
    return cached / prompt, wall

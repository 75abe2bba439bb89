"""A conversation's prefix pulled from a peer replica on real Ray Serve: two replicas of a tiny
Mamba hybrid behind `HybridPrefixRouter`; while the replica holding a conversation is busy (the
in-flight bound is one request), its next turn goes to the other replica, which pulls the
prefix instead of recomputing it: the turn is served from its cache, its greedy tokens equal
the offline engine's, and the pull counter moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray import serve
from ray.serve.config import HTTPOptions

from cluster.llm import LLM
from cluster.openai_api.protocol import ChatCompletionRequest
from cluster.serve import build_openai_app, deployment_name
from scheduler.request import SamplingParams
from tests.helpers.ray_local import NODE_IP
from tests.helpers.serve_app import free_port, save_word_tokenizer, shutdown_serve
from tests.helpers.tiny_hybrid import save_tiny_hybrid

pytestmark = pytest.mark.ray
RAY_CPUS = 4

APP = "pull"
MODEL = "tiny-hybrid"
ENGINE = {"dtype": "float32", "block_size": 4, "max_num_seqs": 8}
ROUTER = {
    "request_router_class": "cluster.serve.routing:HybridPrefixRouter",
    "request_routing_stats_period_s": 0.2,
    "request_router_kwargs": {
        "min_in_flight_bound": 1,
        "load_factor": 1.0,
        "pull_threshold_tokens": 8,
        "pull_timeout_s": 60,
    },
}
FIRST = [{"role": "user", "content": " ".join(f"t{20 + i}" for i in range(40))}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pull-bamba")
    save_tiny_hybrid("bamba", path)
    return save_word_tokenizer(path)


@pytest.fixture(scope="module")
def handle(ray_cluster: None, model_dir: Path) -> Iterator[Any]:
    config = {
        "model_loading_config": {"model_id": MODEL, "model_source": str(model_dir)},
        "engine_kwargs": {
            **ENGINE,
            "device": "cpu",
            "distributed_executor_backend": "uni",
            "kv_cache_memory_bytes": 2 << 20,
        },
        "placement_group_config": {"bundles": [{"CPU": 0.25}]},
        "deployment_config": {
            "num_replicas": 2,
            "ray_actor_options": {"num_cpus": 0.1},
            "request_router_config": ROUTER,
        },
    }
    app = {
        "llm_configs": [config],
        "ingress_deployment_config": {"ray_actor_options": {"num_cpus": 0.1}},
    }
    serve.start(http_options=HTTPOptions(host=NODE_IP, port=free_port()))
    serve.run(build_openai_app(app), name=APP, route_prefix="/")
    yield serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    shutdown_serve()


def chat(handle: Any, messages: list[dict[str, str]], request_id: str, max_tokens: int) -> Any:
    """The stream of a greedy chat request through the handle (this process's router)."""
    request = ChatCompletionRequest(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    return iter(handle.options(stream=True).generate.remote(request, request_id, False))


def answer(chunks: list[Any]) -> tuple[str, int]:
    """The streamed text and the usage's cached prompt tokens."""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    return text, usage.prompt_tokens_details.cached_tokens


def test_a_turn_sent_away_from_its_replica_pulls_the_prefix(handle: Any, model_dir: Path) -> None:
    first_text, _ = answer(list(chat(handle, FIRST, "turn-1", 4)))
    router = handle._router._asyncio_router.request_router
    second = [
        *FIRST,
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "t90 t91 t92"},
    ]
    busy = chat(handle, [*FIRST, {"role": "user", "content": "t80"}], "busy", 64)
    next(busy)  # routed (to the holder of the conversation), in flight
    text, cached = answer(list(chat(handle, second, "turn-2", 4)))
    list(busy)
    assert cached >= 32  # the first turn's prompt (43 tokens) came from a cache
    llm = LLM(str(model_dir), **ENGINE, kv_cache_memory_bytes=2 << 20, enable_prefix_caching=False)
    try:
        reference = [FIRST, second]
        outputs = llm.chat(reference, SamplingParams(temperature=0, max_tokens=4))
    finally:
        llm.shutdown()
    assert [first_text, text] == [out.outputs[0].text for out in outputs]
    stats = [
        handle.transfer_stats.remote(to_replica=replica.unique_id).result()
        for replica in router.curr_replicas
    ]
    assert sum(s["pulls"] for s in stats) == 1, stats
    assert sum(s["recomputes"] for s in stats) == 0, stats

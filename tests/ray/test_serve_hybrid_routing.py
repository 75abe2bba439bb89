"""`HybridPrefixRouter` on real Ray Serve: two replicas of a tiny hybrid model behind one ingress.

Sliding window + full attention (gemma3) and a Mamba hybrid (bamba), both in the default suite;
one app per model, shared by the tests of the module (the test that kills a replica runs last).
Multi-turn chat sessions come back to the replica that holds them (every later turn is served
from the cache, which a router blind to the caches gets right for about half the turns), greedy
outputs equal the offline `LLM`'s, a replica's evictions reach the router's index, and a replica
that dies leaves it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from cluster.llm import LLM
from cluster.openai_api.protocol import CompletionRequest
from cluster.serve import build_openai_app, deployment_name
from cluster.serve.routing_options import RoutingOptions
from scheduler.request import SamplingParams
from tests.helpers.router_view import local_router, wait_until_heard
from tests.helpers.serve_app import deployed, save_word_tokenizer
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.ray
# Two replicas (a one-CPU rank bundle each) plus the ingress and the replicas' own share.
RAY_CPUS = 4

APP = "routing"
MODEL = "tiny-hybrid"
ROUTER = "cluster.serve.routing:HybridPrefixRouter"
ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_seqs": 16,
    "device": "cpu",
    "distributed_executor_backend": "uni",
}
KV_BYTES = {"gemma3": 1 << 20, "bamba": 2 << 20}
NUM_SESSIONS = 6
NUM_TURNS = 3
MAX_TOKENS = 3
FLOOD_PROMPTS = 240
"""Most 40-token prompts sent to turn every replica's pool over (each holds a few hundred)."""


@dataclass
class Routed:
    base_url: str
    model_dir: Path
    family: str

    def chat(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{self.base_url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return dict(response.json())


def _save_model(family: str, path: Path) -> Path:
    if family == "bamba":
        save_tiny_hybrid("bamba", path)
    else:
        save_tiny_model(family, path, max_position_embeddings=512)
    return save_word_tokenizer(path)


def _app_config(model_dir: Path, family: str) -> dict[str, Any]:
    """Two replicas of the model, each a tenth of a CPU plus a quarter for its engine."""
    router = {"request_router_class": ROUTER, "request_routing_stats_period_s": 0.2}
    config = {
        "model_loading_config": {"model_id": MODEL, "model_source": str(model_dir)},
        "engine_kwargs": {**ENGINE, "kv_cache_memory_bytes": KV_BYTES[family]},
        "placement_group_config": {"bundles": [{"CPU": 0.25}]},
        "deployment_config": {
            "num_replicas": 2,
            "ray_actor_options": {"num_cpus": 0.1},
            "request_router_config": router,
            "health_check_period_s": 1,
        },
    }
    ingress = {"ray_actor_options": {"num_cpus": 0.1}}
    return {"llm_configs": [config], "ingress_deployment_config": ingress}


@pytest.fixture(scope="module", params=["gemma3", "bamba"])
def routed(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Routed]:
    family = str(request.param)
    model_dir = _save_model(family, tmp_path_factory.mktemp(f"routed-{family}"))
    with deployed(build_openai_app(_app_config(model_dir, family)), APP) as address:
        yield Routed(address.base_url, model_dir, family)


def _user_words(session: int, turn: int) -> str:
    """A user message of 12 words, distinct per session and turn."""
    return " ".join(f"t{(7 * session + 3 * turn + i) % 200 + 20}" for i in range(12))


def _play_sessions(routed: Routed) -> list[list[dict[str, Any]]]:
    """Every session's turns, interleaved across sessions; each turn's full response. Between
    rounds the replicas' events reach the routers (this process's router, probed first, has
    heard them)."""
    handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    _complete(handle, "t5 t6", "probe-sessions")
    router = local_router(handle)
    histories: list[list[dict[str, str]]] = [[] for _ in range(NUM_SESSIONS)]
    responses: list[list[dict[str, Any]]] = [[] for _ in range(NUM_SESSIONS)]
    for turn in range(NUM_TURNS):
        for session, history in enumerate(histories):
            history.append({"role": "user", "content": _user_words(session, turn)})
            response = routed.chat(history)
            responses[session].append(response)
            history.append({"role": "assistant", "content": _answer(response)})
        wait_until_heard(router, f"the events of round {turn} reach the routers")
    return responses


def _answer(response: dict[str, Any]) -> str:
    return str(response["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def sessions(routed: Routed) -> list[list[dict[str, Any]]]:
    return _play_sessions(routed)


def test_later_turns_return_to_the_replica_holding_the_session(
    sessions: list[list[dict[str, Any]]],
) -> None:
    for turns in sessions:
        for previous, later in itertools.pairwise(turns):
            cached = later["usage"]["prompt_tokens_details"]["cached_tokens"]
            # The earlier prompt, less its generation prompt and the alignment of a hit.
            assert cached >= previous["usage"]["prompt_tokens"] - 16, (previous, later)


def test_greedy_outputs_match_the_offline_engine(
    routed: Routed, sessions: list[list[dict[str, Any]]]
) -> None:
    engine = {k: v for k, v in ENGINE.items() if k != "device"}
    llm = LLM(
        str(routed.model_dir),
        **engine,
        kv_cache_memory_bytes=KV_BYTES[routed.family],
        enable_prefix_caching=False,
    )
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for session in (0, NUM_SESSIONS - 1):
            history: list[dict[str, str]] = []
            for turn, response in enumerate(sessions[session]):
                history.append({"role": "user", "content": _user_words(session, turn)})
                want = llm.chat(history, greedy)[0].outputs[0].text
                assert _answer(response) == want
                history.append({"role": "assistant", "content": want})
    finally:
        llm.shutdown()


def _complete(handle: Any, prompt: str, request_id: str) -> None:
    request = CompletionRequest(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    list(handle.options(stream=True).generate.remote(request, request_id, False))


def _holders(router: Any, token_ids: list[int], now: float) -> list[Any]:
    prompt = router.policy.prompt_keys(token_ids, None)
    return [key for key in router.curr_replicas if router.policy.predicted_hit(key, prompt, now)]


def test_evictions_reach_the_router(routed: Routed, sessions: list[list[dict[str, Any]]]) -> None:
    """Stored blocks, then their eviction, reach the index through the replicas' events (read
    past the guesses' lifetime, so only what events said counts)."""
    handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    token_ids = [20 + i for i in range(40)]
    _complete(handle, " ".join(f"t{t}" for t in token_ids), "probe-first")
    router = local_router(handle)
    after_guesses = time.monotonic() + RoutingOptions.guess_ttl_s + 1
    holders = wait_until(lambda: _holders(router, token_ids, after_guesses), "the probe's events")
    assert len(holders) == 1
    for number in range(FLOOD_PROMPTS):  # distinct prompts, until the pools have turned over
        words = " ".join(f"t{(number * 37 + i * 11) % 230 + 20}" for i in range(40))
        _complete(handle, words, f"flood-{number}")
        if number % 20 == 19:
            wait_until_heard(router, "the flood's events reach the router")
            if not _holders(router, token_ids, after_guesses):
                break
    assert _holders(router, token_ids, after_guesses) == []


def test_a_dead_replica_leaves_the_index(routed: Routed) -> None:
    handle = serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)
    _complete(handle, "t30 t31 t32 t33 t34 t35 t36 t37 t38", "probe-dead")
    router = local_router(handle)
    victim = next(iter(router.curr_replicas))
    ray.kill(ray.get_actor(victim.to_full_id_str(), namespace="serve"), no_restart=True)

    def served_without_victim() -> bool:  # requests go on meanwhile (the router may pick it)
        _complete(handle, "t40 t41 t42 t43 t44", f"after-{time.monotonic()}")
        return victim not in router.curr_replicas

    wait_until(served_without_victim, "the killed replica leaves routing")
    assert victim not in router.policy.replicas
    _complete(handle, "t50 t51 t52", "still-served")

"""A conversation's prefix pulled from a peer replica on real Ray Serve: two replicas of a tiny
Mamba hybrid behind `HybridPrefixRouter`; while the replica holding a conversation is busy (the
in-flight bound is one request), its next turn goes to the other replica, which pulls the
prefix instead of recomputing it: the turn is served from its cache, its greedy tokens equal
the offline engine's, and the pull counter moves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve import Application
from ray.serve import api as serve_api
from ray.serve.request_router import ReplicaID
from transformers import AutoTokenizer

from cluster.llm import LLM
from cluster.openai_api.protocol import ChatCompletionRequest
from cluster.serve import build_llm_deployment, deployment_name
from cluster.serve.peer_pull import call_replica
from cluster.serve.routing_options import RoutingOptions
from scheduler.request import SamplingParams
from tests.helpers.serve_app import deployed, save_word_tokenizer
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.waiting import wait_until

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
        "drain_handoff_prefixes": 0,  # pulls while a replica drains; hand-offs: their own test
    },
}
DRAIN_S = 6.0
BUSY_TOKENS = 180
"""Steps the request keeping the conversation's replica busy runs (no early end of sequence),
within the model's 256 positions: the next turn is routed as soon as the router counts it in
flight there, and the router's choice shows it was still in flight then."""
FIRST = [{"role": "user", "content": " ".join(f"t{20 + i}" for i in range(40))}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pull-bamba")
    save_tiny_hybrid("bamba", path)
    return save_word_tokenizer(path)


def model_app(
    model_dir: Path,
    num_replicas: int,
    router: dict[str, Any] | None = None,
    drain_loop_s: float = DRAIN_S,
) -> Application:
    """The model's deployment behind `router` (default ROUTER); a fixed version makes a change
    of `num_replicas` a scale (no restart). A replica scaled down drains for `drain_loop_s` at
    least before Serve stops it."""
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
            "num_replicas": num_replicas,
            "graceful_shutdown_wait_loop_s": drain_loop_s,
            "ray_actor_options": {"num_cpus": 0.1},
            "request_router_config": ROUTER if router is None else router,
        },
    }
    app = build_llm_deployment(config)
    app._bound_deployment._version = "1"  # Serve's code version (no public option sets it)
    return app


@pytest.fixture(scope="module")
def handle(ray_cluster: None, model_dir: Path) -> Iterator[Any]:
    with deployed(model_app(model_dir, 2), APP, route_prefix=None):
        yield serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)


def chat(
    handle: Any,
    messages: list[dict[str, str]],
    request_id: str,
    max_tokens: int,
    ignore_eos: bool = False,
) -> Any:
    """The stream of a greedy chat request through the handle (this process's router)."""
    request = ChatCompletionRequest(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, ignore_eos=ignore_eos,
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
    [first_ids] = prompt_ids(model_dir, [FIRST])
    holders = wait_until(lambda: holders_by_events(router, first_ids), "the first turn's events")
    assert len(holders) == 1, holders
    second = [
        *FIRST,
        {"role": "assistant", "content": first_text},
        {"role": "user", "content": "t90 t91 t92"},
    ]
    [holder] = holders
    busy = chat(handle, [*FIRST, {"role": "user", "content": "t80"}], "busy", BUSY_TOKENS, True)
    wait_until(lambda: router.policy.in_flight(holder), "the busy request is routed to its holder")
    text, cached = answer(list(chat(handle, second, "turn-2", 4)))
    choice = router.last_choice  # the second turn's
    list(busy)
    assert choice.in_flight[holder] == 1, choice  # the holder was busy: over the bound
    assert choice.replica != holder, choice
    assert (choice.pull.source if choice.pull else None) == holder.unique_id, choice
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


def conversation(index: int) -> list[dict[str, str]]:
    """A first turn of its own (its first word differs from every other's)."""
    words = [f"t{150 + index}", *(f"t{100 + i}" for i in range(31))]
    return [{"role": "user", "content": " ".join(words)}]


def next_turn(first: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    return [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "t95 t96"}]


def direct(replica: ReplicaID, method: str) -> Any:
    """`method()` called on that replica itself (routable or draining)."""
    return ray.get(call_replica(replica, method).ref, timeout=30)


def is_gone(replica: ReplicaID) -> bool:
    try:
        ray.get_actor(replica.to_full_id_str(), namespace="serve")
    except ValueError:
        return True
    return False


def prompt_ids(model_dir: Path, turns: list[Any]) -> list[list[int]]:
    """Each conversation's prompt as the replicas tokenize it (chat template, generation prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for messages in turns
    ]
    return [tokenizer.encode(text) for text in texts]


def held_by(router: Any, replica: ReplicaID, prompts: list[list[int]], now: float) -> list[int]:
    """The prompts whose prefix the router predicts `replica` caches at `now`, longest first."""
    hits = {}
    for index, token_ids in enumerate(prompts):
        keys = router.policy.prompt_keys(token_ids, None)
        hits[index] = router.policy.predicted_hit(replica, keys, now)
    return sorted((i for i in hits if hits[i] >= 16), key=lambda i: -hits[i])


def holders_by_events(router: Any, token_ids: list[int]) -> list[ReplicaID]:
    """The replicas the router predicts to cache the prompt's prefix from their KV events alone
    (read past the guesses' lifetime; the first request of a deployment leaves no guess anyway:
    the router cannot hash before some replica's events)."""
    after_guesses = time.monotonic() + RoutingOptions.guess_ttl_s + 1
    return [r for r in router.curr_replicas if held_by(router, r, [token_ids], after_guesses)]


def scale_down(handle: Any, app: Application, app_name: str) -> tuple[ReplicaID, ReplicaID]:
    """Redeploy `app` (the deployment at one replica): (the replica Serve drains, the one
    left)."""
    router = handle._router._asyncio_router.request_router
    replicas = list(router.curr_replicas)
    serve_api._run(app, _blocking=False, name=app_name, route_prefix=None)
    wait_until(lambda: len(router.curr_replicas) == 1, "a replica leaves routing")
    [kept] = router.curr_replicas
    [drained] = [replica for replica in replicas if replica != kept]
    return drained, kept


def test_a_draining_replica_is_pulled_from_and_once_gone_its_turns_recompute(
    handle: Any, model_dir: Path
) -> None:
    firsts = [conversation(index) for index in range(6)]
    turns = [
        next_turn(first, answer(list(chat(handle, first, f"first-{index}", 4)))[0])
        for index, first in enumerate(firsts)
    ]
    router = handle._router._asyncio_router.request_router
    prompts = prompt_ids(model_dir, turns)
    for ids in prompts:  # the replicas' KV events reach the router
        wait_until(lambda ids=ids: holders_by_events(router, ids), "a turn's events")
    before = {replica: direct(replica, "transfer_stats") for replica in router.curr_replicas}
    now = time.monotonic()
    holders = {replica: held_by(router, replica, prompts, now) for replica in before}
    drained, kept = scale_down(handle, model_app(model_dir, 1), APP)
    live, gone = holders[drained][:2]
    live_text, live_cached = answer(list(chat(handle, turns[live], "live", 4)))
    sent = direct(drained, "transfer_stats")["blocks_sent"] - before[drained]["blocks_sent"]
    assert sent > 0
    assert direct(drained, "stats")["kv_cache_usage"] == 0.0  # what it sent is not leaked
    after_live = direct(kept, "transfer_stats")
    assert after_live["pulls"] == before[kept]["pulls"] + 1, (before, after_live)
    assert after_live["blocks_received"] > before[kept]["blocks_received"]
    assert live_cached >= 24  # the drained replica's prefix, pulled
    wait_until(lambda: is_gone(drained), "the drained replica is gone")
    started = time.monotonic()
    gone_text, gone_cached = answer(list(chat(handle, turns[gone], "gone", 4)))
    gone_s = time.monotonic() - started
    assert gone_s < 30  # no wait for the dead source
    after_gone = direct(kept, "transfer_stats")  # no pull: the router forgot the dead source,
    assert after_gone["pulls"] == after_live["pulls"], (after_live, after_gone)  # or it failed
    assert after_gone["recomputes"] - before[kept]["recomputes"] in (0, 1), (before, after_gone)
    assert gone_cached < 8
    assert direct(kept, "stats")["kv_cache_usage"] == 0.0
    failed = after_gone["recomputes"] - before[kept]["recomputes"]
    print(
        f"cached: pulled {live_cached}, gone {gone_cached} ({failed} failed pull, {gone_s:.2f} s)"
    )
    assert [live_text, gone_text] == reference_texts(model_dir, [turns[live], turns[gone]])


def reference_texts(model_dir: Path, conversations: list[Any]) -> list[str]:
    """Greedy answers of the offline engine (one engine, no prefix cache)."""
    llm = LLM(str(model_dir), **ENGINE, kv_cache_memory_bytes=2 << 20, enable_prefix_caching=False)
    try:
        outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=4))
    finally:
        llm.shutdown()
    return [out.outputs[0].text for out in outputs]

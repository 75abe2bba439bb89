"""A replica scaled down hands its conversations to its peer on real Ray Serve: two replicas of
a tiny Mamba hybrid behind `HybridPrefixRouter`, several conversations on each, a request in
flight on each; scaled down to one replica, the stopped one's in-flight request finishes, its
recent prefixes are pulled by the one left before it exits (that replica's pull counter moves),
the router sees them there and forgets the stopped replica, and every next turn is served from
the cache with the offline engine's greedy tokens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from ray import serve
from ray.serve import Application

from cluster.llm import LLM
from cluster.serve import deployment_name
from scheduler.request import SamplingParams
from tests.helpers.serve_app import deployed, save_word_tokenizer
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.waiting import wait_until
from tests.ray.test_serve_peer_pull import (
    ENGINE,
    MODEL,
    answer,
    chat,
    conversation,
    direct,
    held_by,
    holders_by_events,
    is_gone,
    next_turn,
    prompt_ids,
    scale_down,
)
from tests.ray.test_serve_peer_pull import ROUTER as PULL_ROUTER
from tests.ray.test_serve_peer_pull import model_app as pull_model_app

pytestmark = pytest.mark.ray
RAY_CPUS = 4

APP = "handoff"
ROUTER = {  # the peer-pull test's router with the hand-off on
    **PULL_ROUTER,
    "request_router_kwargs": {
        **PULL_ROUTER["request_router_kwargs"],
        "pull_timeout_s": 30,
        "drain_handoff_prefixes": 64,
    },
}
NUM_CONVERSATIONS = 6
IN_FLIGHT_TOKENS = 60
"""Tokens of each request in flight while Serve scales down (no early end of sequence)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("handoff-bamba")
    save_tiny_hybrid("bamba", path)
    return save_word_tokenizer(path)


def model_app(model_dir: Path, num_replicas: int) -> Application:
    """The peer-pull test's deployment with the hand-off on and a short drain loop."""
    return pull_model_app(model_dir, num_replicas, ROUTER, drain_loop_s=0.5)


@pytest.fixture(scope="module")
def handle(ray_cluster: None, model_dir: Path) -> Iterator[Any]:
    with deployed(model_app(model_dir, 2), APP, route_prefix=None):
        yield serve.get_deployment_handle(deployment_name(MODEL), app_name=APP)


def in_flight_on_each(handle: Any, router: Any, pool: ThreadPoolExecutor) -> list[Any]:
    """One long request running on each replica (the in-flight bound is one request): the
    futures of their streamed chunks, and their conversations."""
    futures = []
    conversations = []
    for index in range(2):
        first = conversation(NUM_CONVERSATIONS + index)
        stream = chat(handle, first, f"in-flight-{index}", IN_FLIGHT_TOKENS, ignore_eos=True)
        futures.append(pool.submit(list, stream))
        conversations.append(first)
        wait_until(
            lambda n=index + 1: sum(router.policy.in_flight(r) for r in router.curr_replicas) == n,
            "the request is routed",
        )
    assert all(router.policy.in_flight(r) == 1 for r in router.curr_replicas)
    return [futures, conversations]


def test_a_scaled_down_replica_hands_its_conversations_to_its_peer(
    handle: Any, model_dir: Path
) -> None:
    firsts = [conversation(index) for index in range(NUM_CONVERSATIONS)]
    turns = [
        next_turn(first, answer(list(chat(handle, first, f"first-{index}", 4)))[0])
        for index, first in enumerate(firsts)
    ]
    router = handle._router._asyncio_router.request_router  # made by the first request
    prompts = prompt_ids(model_dir, turns)
    for ids in prompts:  # the replicas' KV events reach the router
        wait_until(lambda ids=ids: holders_by_events(router, ids), "a turn's events")
    before = {replica: direct(replica, "transfer_stats") for replica in router.curr_replicas}
    now = time.monotonic()
    holders = {replica: held_by(router, replica, prompts, now) for replica in before}
    with ThreadPoolExecutor(2) as pool:
        futures, long_firsts = in_flight_on_each(handle, router, pool)
        stopped, kept = scale_down(handle, model_app(model_dir, 1), APP)
        started = time.monotonic()
        in_flight = [answer(future.result(timeout=60)) for future in futures]
    wait_until(lambda: is_gone(stopped), "the stopped replica exits", timeout_s=30)
    drain_s = time.monotonic() - started
    assert holders[stopped]  # the stopped replica held some of the conversations
    after = direct(kept, "transfer_stats")
    assert after["pulls"] > before[kept]["pulls"], (before, after)  # the hand-off's pulls
    assert after["recomputes"] == before[kept]["recomputes"], (before, after)
    wait_until(lambda: stopped not in router.policy._replicas, "the router forgets it")
    wait_until(
        lambda: len(held_by(router, kept, prompts, time.monotonic())) == NUM_CONVERSATIONS,
        "the router sees every conversation on the replica left",
    )
    long_turns = [
        next_turn(first, text) for first, (text, _) in zip(long_firsts, in_flight, strict=True)
    ]
    answers = [
        answer(list(chat(handle, messages, f"next-{index}", 4)))
        for index, messages in enumerate([*turns, *long_turns])
    ]
    print(f"drain and hand-off {drain_s:.2f} s; cached {[cached for _, cached in answers]}")
    assert all(cached >= 24 for _, cached in answers), answers
    assert direct(kept, "transfer_stats")["pulls"] == after["pulls"]  # no pull left to do
    long_expected, expected = reference_texts(model_dir, long_firsts, [*turns, *long_turns])
    assert [text for text, _ in in_flight] == long_expected
    assert [text for text, _ in answers] == expected


def reference_texts(
    model_dir: Path, long_firsts: list[Any], next_turns: list[Any]
) -> tuple[list[str], list[str]]:
    """Greedy answers of the offline engine (no prefix cache): the requests in flight
    (IN_FLIGHT_TOKENS, no end of sequence), the next turns (4 tokens)."""
    llm = LLM(str(model_dir), **ENGINE, kv_cache_memory_bytes=2 << 20, enable_prefix_caching=False)
    try:
        long_params = SamplingParams(temperature=0, max_tokens=IN_FLIGHT_TOKENS, ignore_eos=True)
        long_outputs = llm.chat(long_firsts, long_params)
        outputs = llm.chat(next_turns, SamplingParams(temperature=0, max_tokens=4))
    finally:
        llm.shutdown()
    return [o.outputs[0].text for o in long_outputs], [o.outputs[0].text for o in outputs]

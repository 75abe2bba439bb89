"""Prefill/decode disaggregation on real Ray Serve through the `openai` client: a P/D app of the
byte-level tiny model (both sides' engines in their replica's process) answers streaming chat
with usage exactly as the offline engine does, and its structured outputs and tool calls follow
their schema; the decode replica took every prompt's prefix from the prefill replica, whose
pages come over a direct connection between the two replicas (the object store carries them in
the peer-pull tests). A hand-off that the prefill replica holds (its one sequence slot taken by
a long request) while it stops (SIGSTOP) past the deadline, or is killed (SIGKILL), costs a
recompute on the decode side, not the answer, and leaves no hand-off, block, request or offered
page behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import ray
from ray import serve

from cluster.llm import LLM
from cluster.openai_api.protocol import ChatCompletionRequest
from cluster.serve import build_pd_openai_app, deployment_name
from scheduler.request import SamplingParams
from tests.helpers.byte_model import save_byte_model
from tests.helpers.serve_app import deployed, llm_config
from tests.helpers.serve_cases import TOOLS, WEATHER
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.ray
# Two model replicas of 1.25 CPUs each (the replica and its rank bundle) and the ingress.
RAY_CPUS = 4

APP = "pd"
ENGINE = {"block_size": 16, "distributed_executor_backend": "uni"}
ASK = [{"role": "user", "content": "Weather in Paris? Tell me about the next few days, please."}]
SHORT_ASK = [{"role": "user", "content": "Weather in Paris?"}]
KILLED_ASK = [{"role": "user", "content": "Rain in Oslo? Say how long it will last, please."}]
LATE_ASK = [{"role": "user", "content": "Snow in Bern? Say when the roads will be clear."}]
MAX_TOKENS = 24
HAND_OFF_DEADLINE_S = 10.0
"""`kv_transfer_timeout_s`: far above a hand-off of this model (well under a second on a loaded
machine); the deadline test waits it out once."""
BUSY_TOKENS = 900
"""The prefill replica's own long request (its one sequence slot taken: a hand-off queues)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_byte_model(tmp_path_factory.mktemp("byte-model"))


@pytest.fixture(scope="module")
def client(ray_cluster: None, model_dir: Path) -> Iterator[openai.OpenAI]:
    """The P/D app; its prefill side runs one sequence at a time."""
    side = llm_config(model_dir, "bytes", **ENGINE)
    side["deployment_config"]["ray_actor_options"]["num_cpus"] = 0.25
    prefill = llm_config(model_dir, "bytes", **ENGINE, kv_transfer_transport="direct")
    prefill["engine_kwargs"]["max_num_seqs"] = 1
    prefill["deployment_config"] = side["deployment_config"]
    args = {
        "prefill_config": prefill,
        "decode_config": side,
        "kv_transfer_timeout_s": HAND_OFF_DEADLINE_S,
    }
    with deployed(build_pd_openai_app(args), APP) as address:
        yield openai.OpenAI(base_url=f"{address.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, str]:
    """Each asked question's greedy answer on the offline engine (one pool, no P/D)."""
    asks = {"ask": ASK, "killed": KILLED_ASK, "late": LATE_ASK}
    llm = LLM(str(model_dir), **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        outs = llm.chat(list(asks.values()), params)
    finally:
        llm.shutdown()
    return {name: out.outputs[0].text for name, out in zip(asks, outs, strict=True)}


def streamed(client: openai.OpenAI, messages: list[dict[str, Any]]) -> tuple[str, Any]:
    """A greedy streaming chat's text and usage."""
    stream = client.chat.completions.create(
        model="bytes", messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    return text, usage


def handle_of(name: str) -> Any:
    """The handle of one side's deployment ("Prefill" or "Decode")."""
    return serve.get_deployment_handle(f"{name}:{deployment_name('bytes')}", app_name=APP)


def test_pd_streams_the_one_pool_tokens_with_usage(
    client: openai.OpenAI, reference: dict[str, str]
) -> None:
    text, usage = streamed(client, ASK)
    assert text == reference["ask"]
    assert usage is not None
    assert usage.completion_tokens == MAX_TOKENS
    stats = handle_of("Decode").transfer_stats.remote().result()
    assert stats["pulls"] >= 1
    assert stats["recomputes"] == 0
    sent = handle_of("Prefill").transfer_stats.remote().result()
    assert sent["direct_offers"] >= stats["pulls"]


def test_pd_structured_output_and_tool_calls(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="bytes", messages=ASK, temperature=0, max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), WEATHER)
    reply = client.chat.completions.create(
        model="bytes", messages=SHORT_ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=200,
    )  # fmt: skip
    calls = reply.choices[0].message.tool_calls
    assert calls
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def replica_pid(name: str) -> int:
    """The process of the one replica of the `name` side (its engine runs there)."""
    prefix = f"SERVE_REPLICA::{APP}#{name}:"
    actors = ray.util.list_named_actors(all_namespaces=True)
    (actor,) = [a["name"] for a in actors if a["name"].startswith(prefix)]
    replica = ray.get_actor(actor, namespace="serve")
    return int(ray.get(replica.__ray_call__.remote(lambda _: os.getpid()), timeout=30))


def busy_prefill() -> Any:
    """A long request on the prefill replica itself: its one sequence slot stays taken."""
    request = ChatCompletionRequest(
        model="bytes", messages=SHORT_ASK, max_tokens=BUSY_TOKENS, temperature=0, stream=True,
        ignore_eos=True,
    )  # fmt: skip
    return handle_of("Prefill").options(stream=True).generate.remote(request, "busy", False)


def engine_stat(handle: Any, name: str) -> Any:
    """One of the engine stats (`LLMServer.stats`) of the handle's replica."""
    return handle.stats.remote().result()[name]


@dataclass
class HeldHandOff:
    """A chat request whose hand-off waits on the prefill replica, behind its busy request."""

    answer: Future[tuple[str, Any]]
    busy: Any
    prefill_pid: int
    sent_at: float
    """When the request was sent (`time.monotonic`): its hand-off's deadline runs from later."""

    def wait(self, timeout_s: float) -> tuple[str, Any, float]:
        """The answer's text and usage, and how long after it was sent it ended."""
        text, usage = self.answer.result(timeout=timeout_s)
        return text, usage, time.monotonic() - self.sent_at


@contextlib.contextmanager
def held_hand_off(client: openai.OpenAI, messages: list[dict[str, Any]]) -> Iterator[HeldHandOff]:
    """Send `messages` while a long request keeps the prefill replica's one slot: its hand-off
    is accepted there and waits (the decode side counts it in flight)."""
    decode, prefill = handle_of("Decode"), handle_of("Prefill")
    pid = replica_pid("Prefill")
    busy = busy_prefill()
    wait_until(lambda: engine_stat(prefill, "num_running"), "the busy request runs")
    with ThreadPoolExecutor(1) as pool:
        sent_at = time.monotonic()
        answer = pool.submit(streamed, client, messages)
        wait_until(lambda: engine_stat(prefill, "num_waiting"), "the hand-off waits there")
        assert decode.transfer_stats.remote().result()["pulls_in_flight"] == 1
        try:
            yield HeldHandOff(answer, busy, pid, sent_at)
        finally:
            busy.cancel()


def recomputed(before: dict[str, int], usage: Any) -> None:
    """The decode side recomputed one more prompt (cached nothing) and holds nothing."""
    decode = handle_of("Decode")
    after = decode.transfer_stats.remote().result()
    assert (after["recomputes"], after["pulls"]) == (before["recomputes"] + 1, before["pulls"])
    assert after["pulls_in_flight"] == 0
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert engine_stat(decode, "kv_cache_usage") == 0.0


def prefill_holds_nothing() -> bool:
    """No request, block or offered page left on the prefill replica."""
    prefill = handle_of("Prefill")
    engine = prefill.stats.remote().result()
    sends = prefill.transfer_stats.remote().result()["sends_pending"]
    held = (engine["num_running"], engine["num_waiting"], engine["kv_cache_usage"], sends)
    return held == (0, 0, 0.0, 0)


def test_a_stopped_prefill_replica_past_the_deadline_costs_a_recompute(
    client: openai.OpenAI, reference: dict[str, str]
) -> None:
    """The prefill replica holding the hand-off stops (SIGSTOP) until the decode side has
    answered: the deadline passed, the decode side recomputed; resumed, the prefill replica
    drops the hand-off it was holding."""
    before = handle_of("Decode").transfer_stats.remote().result()
    with held_hand_off(client, LATE_ASK) as hand_off:
        os.kill(hand_off.prefill_pid, signal.SIGSTOP)
        try:
            text, usage, seconds = hand_off.wait(HAND_OFF_DEADLINE_S + 120)
        finally:
            os.kill(hand_off.prefill_pid, signal.SIGCONT)
    assert seconds >= HAND_OFF_DEADLINE_S  # the decode side waited for the deadline
    recomputed(before, usage)
    assert text == reference["late"]
    wait_until(prefill_holds_nothing, "the prefill replica holds nothing")


def test_a_killed_prefill_replica_costs_a_recompute_not_the_answer(
    client: openai.OpenAI, reference: dict[str, str]
) -> None:
    """The prefill replica holding the hand-off is killed (SIGKILL): the decode side recomputes
    without waiting for the deadline and answers as one pool does."""
    before = handle_of("Decode").transfer_stats.remote().result()
    with held_hand_off(client, KILLED_ASK) as hand_off:
        os.kill(hand_off.prefill_pid, signal.SIGKILL)
        text, usage, seconds = hand_off.wait(HAND_OFF_DEADLINE_S + 120)
    assert seconds < HAND_OFF_DEADLINE_S  # the death ended the hand-off, not its deadline
    recomputed(before, usage)
    assert text == reference["killed"]

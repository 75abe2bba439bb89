"""Prefill/decode disaggregation on real Ray Serve through the `openai` client: a P/D app of the
byte-level tiny model (both sides' engines in their replica's process) answers streaming chat
with usage exactly as the offline engine does, and its structured outputs and tool calls follow
their schema; the decode replica took every prompt's prefix from the prefill replica, whose
pages come over a direct connection between the two replicas (the object store carries them in
the peer-pull tests)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from ray import serve

from cluster.llm import LLM
from cluster.serve import build_pd_openai_app, deployment_name
from scheduler.request import SamplingParams
from tests.helpers.byte_model import save_byte_model
from tests.helpers.serve_app import deployed, llm_config
from tests.helpers.serve_cases import TOOLS, WEATHER

pytestmark = pytest.mark.ray
# Two model replicas of 1.25 CPUs each (the replica and its rank bundle) and the ingress.
RAY_CPUS = 4

APP = "pd"
ENGINE = {"block_size": 16, "distributed_executor_backend": "uni"}
ASK = [{"role": "user", "content": "Weather in Paris? Tell me about the next few days, please."}]
SHORT_ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_byte_model(tmp_path_factory.mktemp("byte-model"))


@pytest.fixture(scope="module")
def client(ray_cluster: None, model_dir: Path) -> Iterator[openai.OpenAI]:
    side = llm_config(model_dir, "bytes", **ENGINE)
    side["deployment_config"]["ray_actor_options"]["num_cpus"] = 0.25
    prefill = llm_config(model_dir, "bytes", **ENGINE, kv_transfer_transport="direct")
    prefill["deployment_config"] = side["deployment_config"]
    args = {"prefill_config": prefill, "decode_config": side, "kv_transfer_timeout_s": 60}
    with deployed(build_pd_openai_app(args), APP) as address:
        yield openai.OpenAI(base_url=f"{address.base_url}/v1", api_key="none", max_retries=0)


def reference_text(model_dir: Path, messages: list[dict[str, Any]]) -> str:
    llm = LLM(str(model_dir), **ENGINE)
    try:
        (out,) = llm.chat([messages], SamplingParams(temperature=0, max_tokens=24))
    finally:
        llm.shutdown()
    return out.outputs[0].text


def test_pd_streams_the_one_pool_tokens_with_usage(client: openai.OpenAI, model_dir: Path) -> None:
    stream = client.chat.completions.create(
        model="bytes", messages=ASK, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == reference_text(model_dir, ASK)
    assert usage is not None
    assert usage.completion_tokens == 24
    decode = serve.get_deployment_handle("Decode:" + deployment_name("bytes"), app_name=APP)
    stats = decode.transfer_stats.remote().result()
    assert stats["pulls"] >= 1
    assert stats["recomputes"] == 0
    prefill = serve.get_deployment_handle("Prefill:" + deployment_name("bytes"), app_name=APP)
    sent = prefill.transfer_stats.remote().result()
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

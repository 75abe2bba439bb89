"""The OpenAI HTTP and gRPC APIs on one real Ray Serve app, through the `openai` client.

Every test runs on both topologies: two hops (proxy -> ingress -> model deployment) and one hop
(the model deployment serves the routes itself).

Greedy outputs are compared with the offline `LLM` on the same tiny model; the word-level
tokenizer maps each token to one word, so equal text means equal tokens. A second tiny model
(`bytes`, a byte-level tokenizer, in-process executor) serves the structured-output and
tool-call tests, and a third (`vlm`, the tiny Gemma 3 vision-language model, in-process
executor) the image tests, on two hops. The served `/openapi.json` describes every route, and
schemathesis fuzzes the routes against it (`tests/helpers/openapi_fuzz.py`). Near the end a test
kills the replica's worker actor mid-stream: the stream ends with an error event, the next
request runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
import ray
import torch
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor

from cluster.config import API_KEY_ENV
from cluster.config.env import SERVER_DEV_MODE_ENV
from cluster.llm import LLM
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.serve import build_openai_app, deployment_name
from cluster.serve.grpc import llm_pb2, llm_pb2_grpc
from scheduler.request import SamplingParams
from tests.helpers.byte_model import save_byte_model
from tests.helpers.openapi_fuzz import (
    FUZZED,
    OPERATIONS,
    POSITIVE,
    GenerationMode,
    fuzz_operation,
    load_schema,
)
from tests.helpers.ray_local import NODE_IP
from tests.helpers.ray_state import live_engine_actors
from tests.helpers.serve_app import (
    deployed,
    llm_config,
    save_tiny_served_model,
)
from tests.helpers.serve_cases import (
    DASHBOARD_SERVE_SERIES,
    INVALID,
    METRICS,
    TOOLS,
    WEATHER,
    exported,
    has_metric,
    metric_samples,
    request_bodies,
)
from tests.helpers.tiny_image_processor import (
    add_chat_template,
    data_url,
    image_part,
    png_bytes,
)
from tests.helpers.tiny_vlm import hf_greedy_with_images, random_image, save_tiny_gemma3_vlm
from tests.helpers.weight_updates import perturbed_checkpoint

pytestmark = pytest.mark.ray
# Two model deployments (a one-CPU rank bundle each) and the ingress run at once, and the
# served fixture's two topologies may overlap while one shuts down: more than 2 CPUs.
RAY_CPUS = 4

API_KEY = "sk-test-key"
APP = "openai"
PROMPTS = ["t5 t17 t33 t2 t9", "t100 t3", "t7 t7 t7 t8 t9 t10 t11"]
CHAT = [{"role": "system", "content": "t4 t5"}, {"role": "user", "content": "t9 t10 t11"}]


ROUTER = "ray.serve.llm.request_router.PrefixCacheAffinityRouter"
METADATA = (("application", APP), ("authorization", f"Bearer {API_KEY}"))


@dataclass
class Served:
    base_url: str
    model_dir: Path
    stub: llm_pb2_grpc.LLMServiceStub
    topology: str

    @property
    def model_ids(self) -> list[str]:
        return ["tiny", "bytes", "vlm"] if self.topology == "two_hop" else ["tiny"]

    def needs_byte_model(self) -> None:
        if self.topology != "two_hop":
            pytest.skip("the byte-level model is served on two hops only (one hop: one model)")

    def needs_vlm(self) -> None:
        if self.topology != "two_hop":
            pytest.skip("the image model is served on two hops only (one hop: one model)")

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0)

    def post(
        self,
        path: str,
        body: Any,
        key: str | None = API_KEY,
        headers: dict[str, str] | None = None,
        timeout: Any = 60,
    ) -> httpx.Response:
        headers = {**(headers or {}), **({"Authorization": f"Bearer {key}"} if key else {})}
        content = body if isinstance(body, str | bytes) else json.dumps(body)
        return httpx.post(self.base_url + path, content=content, headers=headers, timeout=timeout)

    def stats(self) -> dict[str, Any]:
        handle = serve.get_deployment_handle(deployment_name("tiny"), app_name=APP)
        return handle.stats.remote().result()


def _app_config(
    model_dir: Path, byte_model_dir: Path | None, vlm_dir: Path | None = None
) -> dict[str, Any]:
    """The tiny model behind Ray's prefix-aware router, draining for up to 30 s; an API key;
    the byte-level and image models when given (their engines in their replicas' processes:
    no rank actor)."""
    config = llm_config(model_dir)
    config["deployment_config"].update(
        {
            "request_router_config": {
                "request_router_class": ROUTER,
                "request_router_kwargs": {"imbalanced_threshold": 4},
            },
            "graceful_shutdown_timeout_s": 30,
            "graceful_shutdown_wait_loop_s": 0.2,
        }
    )
    env = {API_KEY_ENV: API_KEY, SERVER_DEV_MODE_ENV: "1"}  # the development routes' tests
    ingress = {"num_cpus": 0.25, "runtime_env": {"env_vars": env}}
    configs = [config]
    if byte_model_dir is not None:
        configs.append(
            llm_config(byte_model_dir, "bytes", block_size=16, distributed_executor_backend="uni")
        )
    if vlm_dir is not None:
        vlm = llm_config(vlm_dir, "vlm", distributed_executor_backend="uni")
        vlm["deployment_config"]["ray_actor_options"]["num_cpus"] = 0.25
        vlm["placement_group_config"] = {"bundles": [{"CPU": 0.25}]}  # no rank actor to hold
        configs.append(vlm)
    return {
        "llm_configs": configs,
        "ingress_deployment_config": {"ray_actor_options": ingress},
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_served_model(tmp_path_factory.mktemp("served-model"))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The tiny Gemma 3 vision-language model's folder (with a chat template) and the
    transformers model."""
    folder = tmp_path_factory.mktemp("vlm")
    model = save_tiny_gemma3_vlm(folder)
    add_chat_template(folder)
    return folder, model


@pytest.fixture(scope="module", params=["two_hop", "one_hop"])
def served(
    ray_cluster: None,
    model_dir: Path,
    vlm: tuple[Path, Any],
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Served:
    # One hop serves a single model: the byte-level and image models' tests run on two hops only.
    two_hop = request.param == "two_hop"
    byte_model_dir = save_byte_model(tmp_path_factory.mktemp("byte-model")) if two_hop else None
    vlm_dir = vlm[0] if two_hop else None
    args = {**_app_config(model_dir, byte_model_dir, vlm_dir), "topology": request.param}
    with deployed(build_openai_app(args), APP) as address:
        channel = grpc.insecure_channel(f"{NODE_IP}:{address.grpc_port}")
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        yield Served(address.base_url, model_dir, stub, request.param)
        channel.close()


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLM:
    llm = LLM(
        str(model_dir),
        block_size=4,
        kv_cache_memory_bytes=8 * 1024 * 1024,
        distributed_executor_backend="uni",
    )
    yield llm
    llm.shutdown()


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def test_completions_match_llm_generate(served: Served, reference: LLM) -> None:
    expected = [r.outputs[0].text for r in reference.generate(PROMPTS, GREEDY)]
    client = served.client
    for prompt, want in zip(PROMPTS, expected, strict=True):
        result = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert result.choices[0].text == want
        assert result.choices[0].finish_reason == "length"
        assert result.usage.completion_tokens == 6
        assert result.usage.prompt_tokens == len(prompt.split())
        chunks = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in chunks) == want


def test_dev_routes_update_weights_from_a_checkpoint_folder(
    served: Served, reference: LLM, model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's weight-update routes: new weights from a folder serve a fresh engine's tokens
    (the prompt cached under the old ones), the version is the one given; a checkpoint of
    other shapes is a 400 in one line and the old weights keep serving; the old weights back."""
    new = perturbed_checkpoint(model_dir, tmp_path / "new", seed=5, scale=1.0)
    fresh = LLM(
        str(new), block_size=4, kv_cache_memory_bytes=8 << 20, distributed_executor_backend="uni"
    )
    want_new = fresh.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text
    fresh.shutdown()
    want_old = reference.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text
    assert want_new != want_old
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def complete() -> str:
        result = served.client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0
        )
        return result.choices[0].text

    with httpx.Client(base_url=served.base_url.removesuffix("/v1"), headers=headers) as http:

        def call(method: str, path: str, status: int = 200, **kwargs: Any) -> Any:
            response = http.request(method, path, params={"model": "tiny"}, timeout=120, **kwargs)
            assert response.status_code == status, response.text
            return response.json() if response.content else None

        def update(folder: Path, version: str) -> None:
            call("POST", "/start_weight_update")
            call("POST", "/update_weights", json={"update_info": {"weights_path": str(folder)}})
            call("POST", "/finish_weight_update", json={"weight_version": version})

        assert complete() == want_old  # cached under the old weights
        update(new, "v1")
        assert call("GET", "/get_weight_version") == {"weight_version": "v1"}
        assert complete() == want_new
        wrong = perturbed_checkpoint(model_dir, tmp_path / "wrong", seed=6)
        tensors = load_file(str(wrong / "model.safetensors"))
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 5)
        save_file(tensors, str(wrong / "model.safetensors"), metadata={"format": "pt"})
        update_path = {"update_info": {"weights_path": str(wrong)}}
        call("POST", "/start_weight_update")
        call("POST", "/update_weights", json=update_path)
        message = call("POST", "/finish_weight_update", 400, json={})["error"]["message"]
        assert "does not fit" in message, message
        assert "\n" not in message, message
        assert call("GET", "/get_weight_version") == {"weight_version": "v1"}
        assert complete() == want_new
        update(model_dir, "v2")
        assert complete() == want_old


def test_dev_routes_sleep_wake_pause_and_collective_rpc(served: Served, reference: LLM) -> None:
    """vLLM's development routes (dev mode on in this app): the engine sleeps at both levels
    and wakes to the same tokens, pauses and resumes, runs a worker method on its rank; bad
    input is a 400 with a one-line message."""
    want = reference.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=served.base_url, headers=headers) as http:

        def call(method: str, path: str, json: Any = None, **params: str) -> Any:
            response = http.request(method, path, params={"model": "tiny", **params}, json=json)
            assert response.status_code == 200, response.text
            return response.json() if response.content else None

        for level in ("1", "2"):
            call("POST", "/sleep", level=level)
            assert call("GET", "/is_sleeping") == {"is_sleeping": True}
            call("POST", "/wake_up", tags="weights")
            assert call("GET", "/is_sleeping") == {"is_sleeping": True}
            call("POST", "/wake_up", tags="kv_cache")
            assert call("GET", "/is_sleeping") == {"is_sleeping": False}
            result = served.client.completions.create(
                model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0
            )
            assert result.choices[0].text == want
        assert call("POST", "/pause", mode="wait") == {"status": "paused"}
        assert call("GET", "/is_paused") == {"is_paused": True}
        assert call("POST", "/resume") == {"status": "resumed"}
        assert len(call("POST", "/collective_rpc", json={"method": "cpu_threads"})["results"]) == 1
        for path, params, body in [
            ("/collective_rpc", {}, {"method": "no_such_method"}),
            ("/sleep", {"level": "7"}, None),
            ("/pause", {"mode": "later"}, None),
            ("/wake_up", {"tags": "gpu"}, None),
        ]:
            response = http.post(path, params={"model": "tiny", **params}, json=body)
            assert response.status_code == 400, (path, response.status_code, response.text)
            message = response.json()["error"]["message"]
            assert message, response.text
            assert "\n" not in message, message
        assert call("GET", "/is_sleeping") == {"is_sleeping": False}


def test_chat_matches_llm_chat(served: Served, reference: LLM) -> None:
    want = reference.chat(CHAT, GREEDY)[0].outputs[0].text
    client = served.client
    result = client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=6, temperature=0
    )
    assert result.choices[0].message.content == want
    assert result.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage is not None
    assert usage.completion_tokens == 6
    assert usage.total_tokens == usage.prompt_tokens + 6


def test_sampling_fields_shape_the_response(served: Served) -> None:
    client = served.client
    result = client.completions.create(
        model="tiny", prompt="t1 t2 t3", max_tokens=4, n=2, seed=7, temperature=1.0,
        extra_body={"top_k": 20, "min_p": 0.01, "min_tokens": 2, "ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 8
    again = client.completions.create(
        model="tiny", prompt="t1 t2 t3", max_tokens=4, n=2, seed=7, temperature=1.0,
        extra_body={"top_k": 20, "min_p": 0.01, "min_tokens": 2, "ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in result.choices]
    echoed = client.completions.create(
        model="tiny", prompt="t1 t2", max_tokens=2, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith("t1 t2")
    scored = client.completions.create(
        model="tiny", prompt="t1 t2", max_tokens=3, temperature=0, logprobs=2
    )
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens) == 3
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(entry.top_logprobs) == 3 for entry in content)


def test_request_id_is_echoed_and_used(served: Served) -> None:
    response = served.post(
        "/v1/completions",
        {"model": "tiny", "prompt": "t1", "max_tokens": 2},
        headers={"x-request-id": "trace-42"},
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"


def test_models_and_health(served: Served) -> None:
    models = served.client.models.list()
    assert [m.id for m in models.data] == served.model_ids
    assert served.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("missing")
    assert httpx.get(served.base_url + "/health").status_code == 200


def test_32_concurrent_streams_complete(served: Served) -> None:
    async def one(client: openai.AsyncOpenAI, index: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model="tiny", prompt=f"t{index + 1} t2", max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        tokens, reason = 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return tokens, reason

    async def run() -> list[tuple[int, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key=API_KEY)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(run()) == [(8, "length")] * 32


def _assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"), INVALID)
def test_invalid_requests_get_openai_errors(
    served: Served, path: str, body: Any, status: int, param: str | None
) -> None:
    error = _assert_openai_error(served.post(path, body), status)
    if param is not None:
        assert (error["param"] or "").startswith(param)
    if isinstance(body, dict):  # the same error before a stream starts: not a 200 stream
        streamed = served.post(path, {**body, "stream": True})
        _assert_openai_error(streamed, status)


def test_api_key_is_required(served: Served) -> None:
    body = {"model": "tiny", "prompt": "t1", "max_tokens": 1}
    for key in (None, "wrong"):
        error = _assert_openai_error(served.post("/v1/completions", body, key=key), 401)
        assert error["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="bad").models.list()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.one_of(
        st.tuples(st.just("/v1/completions"), request_bodies(CompletionRequest)),
        st.tuples(st.just("/v1/chat/completions"), request_bodies(ChatCompletionRequest)),
    )
)
def test_fuzzed_bodies_never_get_a_5xx(served: Served, data: tuple[str, dict[str, Any]]) -> None:
    path, body = data
    response = served.post(path, body)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert "error" in response.json()


def test_every_route_is_described(served: Served) -> None:
    document = httpx.get(f"{served.base_url}/openapi.json", timeout=30).json()
    paths = document["paths"]
    described = [f"{method.upper()} {path}" for path, ops in paths.items() for method in ops]
    assert sorted(described) == sorted(OPERATIONS)
    schemas = document["components"]["schemas"]
    for path, body_model, chunk_model in [
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionChunk"),
    ]:
        operation = paths[path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{body_model}"}
        streamed = operation["responses"]["200"]["content"]["text/event-stream"]["schema"]
        done, chunk = streamed["properties"]["data"]["anyOf"]
        assert done == {"const": "[DONE]"}
        assert {"$ref": f"#/components/schemas/{chunk_model}"} in chunk["contentSchema"]["anyOf"]
        assert chunk_model in schemas
    for path, ops in paths.items():
        for operation in ops.values():
            error = operation["responses"]["default"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}, path
    assert {"prompt", "max_tokens", "logprobs"} <= set(schemas["CompletionRequest"]["properties"])
    assert schemas["ModelList"]["properties"]["data"]["items"]["$ref"].endswith("/ModelCard")


@pytest.fixture(scope="module")
def openapi_schema(served: Served) -> Any:
    return load_schema(served.base_url)


@pytest.mark.parametrize(("label", "mode", "examples"), FUZZED)
def test_fuzzed_requests_get_documented_answers(
    served: Served, openapi_schema: Any, label: str, mode: GenerationMode, examples: int
) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    answered = fuzz_operation(openapi_schema, served.base_url, label, mode, examples, auth, "tiny")
    if label.startswith("POST") and mode == POSITIVE:  # the documented examples ran
        assert {(200, "application/json"), (200, "text/event-stream")} <= answered, answered


def test_server_is_healthy_after_the_fuzz(served: Served) -> None:
    assert httpx.get(served.base_url + "/health").status_code == 200
    result = served.client.completions.create(model="tiny", prompt="t1", max_tokens=2)
    assert result.choices[0].finish_reason == "length"
    _wait_idle(served)


def _wait_idle(served: Served, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    stats = served.stats()
    while stats["num_running"] or stats["num_waiting"] or stats["kv_cache_usage"]:
        assert time.monotonic() < deadline, f"blocks still held: {stats}"
        time.sleep(0.05)
        stats = served.stats()
    return stats


LONG = {"model": "tiny", "prompt": "t1 t2 t3", "max_tokens": 900, "ignore_eos": True}


def _wait_running(served: Served) -> None:
    deadline = time.monotonic() + 10
    while not served.stats()["num_running"]:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def test_disconnected_stream_frees_its_blocks(served: Served) -> None:
    before = _wait_idle(served)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", served.base_url + "/v1/completions", json={**LONG, "stream": True},
        headers=headers, timeout=30,
    ) as response:  # fmt: skip
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert served.stats()["kv_cache_usage"] > 0
    after = _wait_idle(served)
    assert after["num_aborted"] == before["num_aborted"] + 1, (before, after)
    assert after["num_steps"] - before["num_steps"] < LONG["max_tokens"]


def test_disconnected_request_frees_its_blocks(served: Served) -> None:
    before = _wait_idle(served)
    with pytest.raises(httpx.ReadTimeout):
        served.post("/v1/completions", LONG, timeout=httpx.Timeout(30, read=1.0))
    after = _wait_idle(served)
    assert after["num_aborted"] == before["num_aborted"] + 1, (before, after)
    assert after["num_steps"] - before["num_steps"] < LONG["max_tokens"]


def test_metrics_are_exported_with_sane_values(served: Served) -> None:
    served.client.completions.create(model="tiny", prompt="t1 t2 t3 t4 t5", max_tokens=4)
    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    deadline = time.monotonic() + 60
    samples: dict[str, Any] = {}

    def value(name: str, label: str = "") -> float:
        return sum(
            v
            for labels, v in samples.get(name, ())
            if label in labels and 'model_name="tiny"' in labels
        )

    while True:  # the series may exist already (earlier tests): wait for this request's counts
        samples = metric_samples(httpx.get(url, timeout=10).text)
        missing = [m for m in METRICS if not has_metric(samples, exported(m))]
        missing += [name for name in DASHBOARD_SERVE_SERIES if name not in samples]
        if not missing and value("ray_vllm_generation_tokens_total") >= 4:
            break
        assert time.monotonic() < deadline, f"metrics never exported: {missing}"
        time.sleep(1)

    assert value("ray_vllm_generation_tokens_total") >= 4
    assert value("ray_vllm_prompt_tokens_total") >= 5
    assert value("ray_vllm_request_success_total", 'finished_reason="length"') >= 1
    assert value("ray_vllm_time_to_first_token_seconds_count") >= 1
    assert 0 < value("ray_vllm_time_to_first_token_seconds_sum") < 60
    assert 0 <= value("ray_vllm_kv_cache_usage_perc") <= 1
    assert value("ray_vllm_prefix_cache_queries_total") >= value("ray_vllm_prefix_cache_hits_total")
    alive = [  # one series per replica that ever served (a replaced one keeps its last value)
        v for labels, v in samples["ray_hybridserve_worker_alive"] if 'rank="0"' in labels
    ]
    assert alive
    assert set(alive) == {1.0}
    assert any('kind="full_attention"' in labels for labels, _ in samples[
        "ray_hybridserve_kv_cache_group_usage_perc"
    ])  # fmt: skip


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_json_schema_response_format_through_the_client(served: Served) -> None:
    served.needs_byte_model()
    reply = served.client.chat.completions.create(
        model="bytes",
        messages=ASK,
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), WEATHER)


def test_an_image_through_the_client(served: Served, vlm: tuple[Path, Any]) -> None:
    """A base64 image gets transformers' greedy tokens, over HTTP and gRPC; a corrupt one gets a
    400 naming its part while another image request streams on and completes."""
    served.needs_vlm()
    folder, model = vlm
    image = random_image(0)
    parts = [{"type": "text", "text": "t5 t6"}, image_part(data_url(image))]
    messages: Any = [{"role": "user", "content": parts}]
    long = served.client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=100, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = iter(long)
    next(chunks)
    corrupt = "data:image/png;base64," + base64.b64encode(png_bytes(image)[:200]).decode()
    bad: Any = [{"role": "user", "content": [parts[0], image_part(corrupt)]}]
    with pytest.raises(openai.BadRequestError) as refused:
        served.client.chat.completions.create(model="vlm", messages=bad, max_tokens=4)
    assert "messages[0].content[1]: image could not be decoded" in refused.value.message
    assert [chunk.usage.completion_tokens for chunk in chunks if chunk.usage] == [100]
    reply = served.client.chat.completions.create(
        model="vlm", messages=messages, max_tokens=8, temperature=0
    )
    processor = AutoProcessor.from_pretrained(folder)
    template_view = [{"role": "user", "content": [parts[0], {"type": "image"}]}]
    text = processor.apply_chat_template(template_view, tokenize=False, add_generation_prompt=True)
    inputs = dict(processor(text=text, images=[image], return_tensors="pt"))
    expected, _ = hf_greedy_with_images(model, inputs, 8)
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
    content = reply.choices[0].message.content.split()
    assert content == processor.tokenizer.convert_ids_to_tokens(expected)
    body = {"model": "vlm", "messages": [{"role": "user", "content_parts": parts}], "max_tokens": 8}
    over_grpc = served.stub.ChatCompletion(
        json_format.ParseDict({**body, "temperature": 0}, llm_pb2.ChatCompletionRequest()),
        metadata=METADATA,
    )
    assert over_grpc.choices[0].message.content == reply.choices[0].message.content


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_calls_through_the_client(served: Served, choice: Any) -> None:
    served.needs_byte_model()
    reply = served.client.chat.completions.create(
        model="bytes", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=200
    )
    calls = reply.choices[0].message.tool_calls
    assert calls
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = served.client.chat.completions.create(
        model="bytes", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=200, stream=True,
    )  # fmt: skip
    streamed: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_grpc_tool_calls(served: Served) -> None:
    served.needs_byte_model()
    request = json_format.ParseDict(
        {
            "model": "bytes",
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 100,
            "temperature": 0,
        },
        llm_pb2.ChatCompletionRequest(),
    )
    whole = served.stub.ChatCompletion(request, metadata=METADATA)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_an_invalid_schema_is_a_400_through_the_client(served: Served) -> None:
    served.needs_byte_model()
    with pytest.raises(openai.BadRequestError, match="regex"):
        served.client.chat.completions.create(
            model="bytes", messages=ASK, extra_body={"structured_outputs": {"regex": "(a"}}
        )


def test_grpc_streams_tokens(served: Served, reference: LLM) -> None:
    want = reference.generate(["t3 t4 t5"], GREEDY)[0].outputs[0].text
    request = llm_pb2.CompletionRequest(
        model="tiny",
        prompt="t3 t4 t5",
        max_tokens=6,
        temperature=0,
        stream_options=llm_pb2.StreamOptions(include_usage=True),
    )
    chunks = list(served.stub.CompletionStream(request, metadata=METADATA))
    texts = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len(texts) >= 2, "tokens arrive as separate messages"
    assert "".join(texts) == want
    assert chunks[-1].usage.completion_tokens == 6
    unary = served.stub.Completion(request, metadata=METADATA)
    assert unary.choices[0].text == want
    assert unary.choices[0].finish_reason == "length"


def test_grpc_chat_and_models(served: Served) -> None:
    request = llm_pb2.ChatCompletionRequest(
        model="tiny",
        messages=[llm_pb2.ChatMessage(role="user", content="t8 t9")],
        max_tokens=3,
        temperature=0,
    )
    whole = served.stub.ChatCompletion(request, metadata=METADATA)
    streamed = list(served.stub.ChatCompletionStream(request, metadata=METADATA))
    assert whole.choices[0].message.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in streamed) == whole.choices[0].message.content
    models = served.stub.ListModels(llm_pb2.ListModelsRequest(), metadata=METADATA)
    assert [m.id for m in models.models] == served.model_ids


def test_scoring_through_the_client(served: Served, reference: LLM) -> None:
    """echo + logprobs in OpenAI's legacy format, vLLM's prompt_logprobs, and a batch of
    prompts, each scored as the offline API scores it."""
    prompt = "t5 t17 t33 t2 t9"
    want = reference.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    result = served.client.completions.create(
        model="tiny", prompt=[prompt, "t100 t3"], echo=True, logprobs=1, max_tokens=1,
        temperature=0, extra_body={"prompt_logprobs": 1},
    )  # fmt: skip
    first, second = sorted(result.choices, key=lambda choice: choice.index)
    assert first.logprobs.tokens[:5] == prompt.split()
    assert second.logprobs.tokens[:2] == ["t100", "t3"]
    assert first.logprobs.token_logprobs[0] is None
    expected = [want.prompt_logprobs[i][want.prompt_token_ids[i]].logprob for i in range(1, 5)]
    assert first.logprobs.token_logprobs[1:5] == pytest.approx(expected, abs=1e-5)
    scored = first.model_extra["prompt_logprobs"]
    assert scored[0] is None
    assert [scored[i][str(want.prompt_token_ids[i])]["logprob"] for i in range(1, 5)] == (
        pytest.approx(expected, abs=1e-5)
    )


def test_grpc_scoring(served: Served) -> None:
    request = llm_pb2.CompletionRequest(
        model="tiny", prompt="t3 t4 t5", max_tokens=1, temperature=0, echo=True, logprobs=1,
        prompt_logprobs=0,
    )  # fmt: skip
    (choice,) = served.stub.Completion(request, metadata=METADATA).choices
    logprobs = json_format.MessageToDict(choice.logprobs)
    assert logprobs["tokens"] == ["t3", "t4", "t5", choice.text.split()[-1]]
    assert logprobs["token_logprobs"][0] is None
    positions = json_format.MessageToDict(choice)["promptLogprobs"]
    assert positions[0] is None
    assert len(positions) == 3


def test_lm_evaluation_harness_scores_a_multiple_choice_task(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-evaluation-harness's `local-completions` model against the server, on a task from a
    local JSON file: each choice's loglikelihood equals transformers' over the same weights, and
    its accuracy is the share of questions whose answer transformers scores highest."""
    from tests.helpers import lm_eval_task

    for name, value in lm_eval_task.harness_environment(tmp_path, API_KEY).items():
        monkeypatch.setenv(name, value)
    task_dir = lm_eval_task.write_task(tmp_path)
    results = lm_eval_task.run_harness(served.base_url, served.model_dir, task_dir)
    want = lm_eval_task.offline_loglikelihoods(served.model_dir)
    (task,) = results["results"].values()
    assert task["acc,none"] == pytest.approx(_accuracy(want, lm_eval_task.QUESTIONS))
    (samples,) = results["samples"].values()
    got = [[resp[0][0] for resp in sample["resps"]] for sample in sorted(samples, key=_doc_id)]
    for ours, theirs in zip(got, want, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-4)


def _accuracy(loglikelihoods: list[list[float]], questions: list[dict[str, Any]]) -> float:
    """The share of questions whose answer has the highest loglikelihood of their choices."""
    right = 0
    for scores, question in zip(loglikelihoods, questions, strict=True):
        best = max(scores)
        assert scores.count(best) == 1, scores  # no tie for the harness to break its own way
        right += scores.index(best) == question["answer"]
    return right / len(questions)


def _doc_id(sample: dict[str, Any]) -> int:
    return int(sample["doc_id"])


@pytest.mark.parametrize(
    ("fields", "metadata", "code"),
    [
        ({"max_tokens": -1}, METADATA, grpc.StatusCode.INVALID_ARGUMENT),
        ({"prompt": " ".join(["t1"] * 1100)}, METADATA, grpc.StatusCode.INVALID_ARGUMENT),
        ({"model": "missing"}, METADATA, grpc.StatusCode.NOT_FOUND),
        ({}, (("application", APP),), grpc.StatusCode.UNAUTHENTICATED),
    ],
)
def test_grpc_errors_are_status_codes(
    served: Served, fields: dict[str, Any], metadata: Any, code: grpc.StatusCode
) -> None:
    request = llm_pb2.CompletionRequest(**{"model": "tiny", "prompt": "t1", **fields})
    stub = served.stub
    for call in (stub.Completion, lambda r, **kw: list(stub.CompletionStream(r, **kw))):
        with pytest.raises(grpc.RpcError) as error:
            call(request, metadata=metadata)
        assert error.value.code() == code
        assert error.value.details()


def test_prefix_router_serves_shared_prefixes(served: Served) -> None:
    prompt = "t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13"
    replies = [
        served.post("/v1/completions", {"model": "tiny", "prompt": f"{prompt} t{40 + i}"})
        for i in range(4)
    ]
    assert [r.status_code for r in replies] == [200] * 4
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert min(cached[1:]) >= 12


# Next to last: it kills the replica's worker actor (the engine restarts it).
def test_worker_killed_mid_stream_ends_the_stream_with_an_error_event(served: Served) -> None:
    (worker,) = [
        actor
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith("hybridserve-") and "-rank" in actor["name"]
    ]
    stream = served.client.completions.create(
        model="tiny", prompt="t1 t2 t3", max_tokens=900, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(worker["name"], namespace=worker["namespace"]), no_restart=True)
    with pytest.raises(openai.APIError, match="tensor-parallel rank 0 died"):
        for _ in chunks:
            pass
    assert time.monotonic() - killed_at < 15.0
    reply = served.client.completions.create(model="tiny", prompt="t1", max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    assert worker["name"] not in live_engine_actors()
    assert httpx.get(served.base_url + "/health").status_code == 200


def test_shutdown_drains_in_flight_requests(served: Served) -> None:
    """Last in the module: deleting the app waits for the request in flight to finish."""
    result: dict[str, Any] = {}

    def request() -> None:
        body = {"model": "tiny", "prompt": "t1 t2", "max_tokens": 300, "ignore_eos": True}
        response = served.post("/v1/completions", body, timeout=120)
        result["status"], result["body"] = response.status_code, response.json()

    thread = threading.Thread(target=request)
    thread.start()
    _wait_running(served)
    serve.delete(APP)  # returns once the replicas have drained and stopped
    thread.join(timeout=60)
    assert result["status"] == 200, result
    assert result["body"]["choices"][0]["finish_reason"] == "length"
    assert result["body"]["usage"]["completion_tokens"] == 300

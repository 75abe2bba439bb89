"""The served `/openapi.json` describes every route, and the routes keep to it: schemathesis
(a property-based fuzzer driven by the schema) sends bodies that fit the documented request
schemas and bodies that break them to a real Serve app (one hop, the tiny model, an API key),
and every answer must be no 5xx, a documented status and content type, and a body that matches
the documented schema (streamed events: each matches the documented chunk or error model).

The fuzzer's generation is bounded (a few examples per operation, no shrinking, derandomized)
and the costly fields of generated bodies are clamped within their documented ranges
(`max_tokens`, `n`; `model` names the served model), so the module takes seconds, not minutes.
The request models' documented examples run first: each generation route answers 200 as JSON
and as a stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from pydantic import BaseModel
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from cluster.config import API_KEY_ENV
from cluster.openai_api.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse
from cluster.serve import build_openai_app
from tests.helpers.serve_app import deployed, llm_config, save_tiny_served_model

pytestmark = pytest.mark.ray

API_KEY = "sk-fuzz-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
OPERATIONS = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /health",
]
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
FUZZED = [
    ("POST /v1/completions", POSITIVE, 12),
    ("POST /v1/completions", NEGATIVE, 8),
    ("POST /v1/chat/completions", POSITIVE, 12),
    ("POST /v1/chat/completions", NEGATIVE, 8),
    ("GET /v1/models", POSITIVE, 1),
    ("GET /v1/models/{model}", POSITIVE, 6),
    ("GET /v1/models/{model}", NEGATIVE, 4),
    ("GET /health", POSITIVE, 1),
]
"""Operation, mode, examples: enough to reach each field, few enough for seconds (an
operation without parameters has one request to make and nothing to break)."""
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
"""Not `negative_data_rejection`: as OpenAI-compatible servers do, a field's value is coerced
where pydantic's lax mode can (`"5"` for 5, `true` for 1.0), so some bodies outside the schema
are answered."""
MAX_TOKENS = 4
MAX_N = 3
STREAMED_CHUNKS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionResponse,
    "/v1/chat/completions": ChatCompletionChunk,
}


@pytest.fixture(scope="module")
def base_url(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir: Path = save_tiny_served_model(tmp_path_factory.mktemp("fuzzed-model"))
    config = llm_config(model_dir, max_model_len=64)  # chat without max_tokens stays short
    ingress = {"ray_actor_options": {"runtime_env": {"env_vars": {API_KEY_ENV: API_KEY}}}}
    args = {"llm_configs": [config], "topology": "one_hop", "ingress_deployment_config": ingress}
    with deployed(build_openai_app(args), "fuzzed") as address:
        yield address.base_url


@pytest.fixture(scope="module")
def schema(base_url: str) -> Any:
    """The served document; every streamed event is read (a chat without `max_tokens` streams
    up to the context's 64 tokens per choice)."""
    loaded = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    loaded.config.max_stream_events = 10_000
    assert loaded.config.max_stream_events_for() == 10_000
    return loaded


def test_every_route_is_described(base_url: str) -> None:
    document = requests.get(f"{base_url}/openapi.json", timeout=30).json()
    described = [
        f"{method.upper()} {path}" for path, ops in document["paths"].items() for method in ops
    ]
    assert sorted(described) == sorted(OPERATIONS)
    schemas = document["components"]["schemas"]
    for path, request_model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ]:
        operation = document["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request_model}"}
        assert set(operation["responses"]["200"]["content"]) == {
            "application/json",
            "text/event-stream",
        }
    for path, ops in document["paths"].items():
        for operation in ops.values():
            error = operation["responses"]["default"]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/ErrorResponse"}, path
    assert {"prompt", "max_tokens", "logprobs"} <= set(schemas["CompletionRequest"]["properties"])
    assert schemas["ModelList"]["properties"]["data"]["items"]["$ref"].endswith("/ModelCard")
    chat_200 = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]
    event = chat_200["content"]["text/event-stream"]["schema"]
    (done, chunk) = event["properties"]["data"]["anyOf"]
    assert done == {"const": "[DONE]"}
    assert {"$ref": "#/components/schemas/ChatCompletionChunk"} in chunk["contentSchema"]["anyOf"]
    assert "ChatCompletionChunk" in schemas


@pytest.mark.parametrize(("label", "mode", "examples"), FUZZED)
def test_fuzzed_requests_get_documented_answers(
    schema: Any, base_url: str, label: str, mode: GenerationMode, examples: int
) -> None:
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label
    answered: set[tuple[int, str]] = set()

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        bound_cost(case.body)
        response = case.call_and_validate(base_url=base_url, headers=AUTH, checks=CHECKS)
        (content_type,) = response.headers.get("content-type", [""])
        answered.add((response.status_code, content_type.split(";")[0]))
        if content_type.startswith("text/event-stream"):
            check_events(response.text, STREAMED_CHUNKS[operation.path])

    fuzz()
    if operation.method.upper() == "POST" and mode == POSITIVE:  # the documented examples ran
        assert {(200, "application/json"), (200, "text/event-stream")} <= answered, answered


def bound_cost(body: Any) -> None:
    """The tiny model, and generation kept short: values stay within the documented ranges."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = "tiny"
    for field in ("max_tokens", "max_completion_tokens"):
        if _is_int(body.get(field)) and body[field] > MAX_TOKENS:
            body[field] = MAX_TOKENS
    if _is_int(body.get("n")) and MAX_N < body["n"] <= 128:
        body["n"] = MAX_N


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_events(text: str, chunk: type[BaseModel]) -> None:
    """Server-sent events as documented: `data: <chunk | error>` lines, then `data: [DONE]`."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line]
    assert events[-1] == "[DONE]", text
    chunk_schema = chunk.model_json_schema(mode="serialization")
    error_schema = ErrorResponse.model_json_schema(mode="serialization")
    for event in events[:-1]:
        body = json.loads(event)
        jsonschema.validate(body, error_schema if "error" in body else chunk_schema)

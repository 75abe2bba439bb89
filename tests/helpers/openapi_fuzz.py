"""Fuzzing a served `/openapi.json` with schemathesis (a property-based fuzzer driven by the
schema): bodies that fit the documented request schemas and bodies that break them, each answer
checked for no 5xx, a documented status and content type, and a body that matches the documented
schema (streamed events too: each a documented chunk or error, then `[DONE]`).

Generation is bounded (a few examples per operation, no shrinking, derandomized) and the costly
fields of generated bodies are clamped within their documented ranges (`max_tokens`, `n`;
`model` names the served model), so an operation takes about a second. The request models'
documented examples are sent first: each generation route answers them with 200, as JSON and
as a stream.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
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

from cluster.openai_api.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse

OPERATIONS = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "GET /health",
    "POST /v1/files",
    "GET /v1/files",
    "GET /v1/files/{file_id}",
    "GET /v1/files/{file_id}/content",
    "DELETE /v1/files/{file_id}",
    "POST /v1/batches",
    "GET /v1/batches",
    "GET /v1/batches/{batch_id}",
    "POST /v1/batches/{batch_id}/cancel",
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


def load_schema(base_url: str) -> Any:
    """The served document; every streamed event is read."""
    loaded = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    loaded.config.max_stream_events = 10_000
    assert loaded.config.max_stream_events_for() == 10_000
    return loaded


def fuzz_operation(
    schema: Any,
    base_url: str,
    label: str,
    mode: GenerationMode,
    examples: int,
    headers: dict[str, str],
    model: str,
) -> set[tuple[int, str]]:
    """Send the operation's documented examples (positive mode) and `examples` generated
    requests of the operation `label`; each answer is checked (an assertion fails on the first
    that breaks the document). Returns the (status, media type) pairs answered."""
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label
    answered: set[tuple[int, str]] = set()

    def send(case: Any) -> None:
        bound_cost(case.body, model)
        response = case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS)
        (content_type,) = response.headers.get("content-type", [""])
        answered.add((response.status_code, content_type.split(";")[0]))
        if content_type.startswith("text/event-stream"):
            check_events(response.text, STREAMED_CHUNKS[operation.path])

    if mode == POSITIVE:
        for example in documented_examples(schema, operation):
            send(operation.Case(body=example, media_type="application/json"))

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
        send(case)

    fuzz()
    return answered


def documented_examples(schema: Any, operation: Any) -> list[Any]:
    """Copies of the examples the operation's request body model documents (none without a
    body)."""
    body = operation.definition.raw.get("requestBody")
    if body is None:
        return []
    name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    examples = schema.raw_schema["components"]["schemas"][name].get("examples", [])
    return copy.deepcopy(list(examples))


def bound_cost(body: Any, model: str) -> None:
    """The served model, and generation kept short: values stay within the documented ranges."""
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = model
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if (field in body and value is None) or (_is_int(value) and value > MAX_TOKENS):
            body[field] = MAX_TOKENS
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS  # else up to the whole context
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

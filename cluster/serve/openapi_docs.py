"""What `/openapi.json` says each HTTP route answers, from the pydantic protocol models.

Request bodies are documented by the routes' typed parameters; this module holds the answers:
a generation route's 200 is its response model as JSON or, with `stream: true`, a
`text/event-stream` whose events (as OpenAPI 3.1 describes a stream: the schema of one event)
carry `data: <chunk JSON>` (or an `ErrorResponse` once the stream has begun), the last one
`data: [DONE]`; every error is OpenAI's `ErrorResponse` (the statuses below, and `default` for
any other, which also stands for FastAPI's 422: a body that fails validation is answered with a
400 in OpenAI's shape). `DescribedApp` adds the streamed chunk models, which no route returns
as JSON, to the document's components.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from cluster.openai_api.protocol import ChatCompletionChunk, CompletionResponse, ErrorResponse

Responses = dict[int | str, dict[str, Any]]

_ERROR_MEANINGS = {
    400: "The request is invalid: a field, the prompt's length or tokens, a field the engine "
    "cannot honour.",
    401: "The API key is missing or wrong (when the server has one).",
    404: "No served model (or LoRA adapter) has this name.",
    503: "The model is unavailable, or the server is overloaded or shutting down.",
    "default": "Any other error (500: an internal error), in OpenAI's error shape.",
}


def error_responses(*statuses: int) -> Responses:
    """The `ErrorResponse` answers of a route: `statuses` and `default`."""
    keys: list[int | str] = [*statuses, "default"]
    return {key: {"model": ErrorResponse, "description": _ERROR_MEANINGS[key]} for key in keys}


STREAMED_MODELS: tuple[type[BaseModel], ...] = (
    CompletionResponse,
    ChatCompletionChunk,
    ErrorResponse,
)
_COMPONENTS = "#/components/schemas/"
DONE_DATA = "[DONE]"


def event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream of `chunk`s: its `data` is a chunk or an error as
    JSON, or the closing `[DONE]`."""
    content = {
        "anyOf": [{"$ref": _COMPONENTS + chunk.__name__}, {"$ref": _COMPONENTS + "ErrorResponse"}]
    }
    data = {
        "anyOf": [
            {"const": DONE_DATA},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": content},
        ]
    }
    return {"type": "object", "required": ["data"], "properties": {"data": data}}


def generation_responses(body: type[BaseModel], chunk: type[BaseModel]) -> Responses:
    """A completions route's answers: `body` as JSON, or a stream of `chunk` events."""
    streamed = (
        f"`stream: false`: one {body.__name__} (application/json). `stream: true`: "
        f"server-sent events (text/event-stream), each `data: <{chunk.__name__} JSON>` "
        "(an error after the stream began: `data: <ErrorResponse JSON>`), then `data: [DONE]`."
    )
    event_stream = {"schema": event_schema(chunk)}
    return {
        200: {
            "model": body,
            "description": streamed,
            "content": {"text/event-stream": event_stream},
        },
        **error_responses(400, 401, 404, 503),
    }


HEALTH_RESPONSES: Responses = {
    200: {"description": "Every model's engine and workers are healthy (an empty body)."},
    **error_responses(503),
}


class DescribedApp(FastAPI):
    """FastAPI whose OpenAPI document also holds the streamed models (referenced by the event
    schemas only)."""

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is not None:  # built once, then served as it is
            return self.openapi_schema
        document = super().openapi()
        components = document.setdefault("components", {}).setdefault("schemas", {})
        _, definitions = models_json_schema(
            [(model, "serialization") for model in STREAMED_MODELS],
            ref_template=_COMPONENTS + "{model}",
        )
        for name, definition in definitions.get("$defs", {}).items():
            components.setdefault(name, definition)
        return document

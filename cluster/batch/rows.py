"""Batch input lines -> checked requests, and engine results -> output rows (pure Python).

Two input formats, one JSON object per line:
- Ray Data LLM rows: `{"id": ..., "prompt": "..." | "messages": [...] | "prompt_token_ids": [...],
  "sampling_params": {vLLM names}}`;
- OpenAI batch lines: `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" |
  "/v1/completions", "body": {...}}`, the body validated with the HTTP API's request models, so
  a batch accepts and rejects exactly what the server does (`stream` must be false, `n` 1).

A line that cannot become a request (bad JSON, no prompt, invalid sampling parameters) becomes a
`BatchItem` carrying its error, so it turns into an `error` output row instead of failing the job.
Output rows keep the input's ID key (`id`, `custom_id`, or `id` = the line index when it has none)
and add Ray Data LLM's columns.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cluster.config.errors import format_validation_error, unknown_key_message
from cluster.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    prompt_logprobs_body,
)
from cluster.openai_api.sampling import to_sampling_params
from cluster.openai_api.tool_output import tool_calls
from cluster.openai_api.tools import tool_call_plan
from scheduler.lora import LoRARequest
from scheduler.request import SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams

OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
_ROW_KEYS = {"id", "custom_id", *_PROMPT_KEYS, "sampling_params", "lora_request"}
_PARAM_NAMES = frozenset(field.name for field in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class BatchItem:
    """One input line, ready for an engine replica (or carrying why it cannot run)."""

    index: int
    id_key: str
    """The output column holding the ID: "id" or "custom_id"."""
    row_id: Any
    """The input's ID value (the line index when the line has none)."""
    request: dict[str, Any] | None
    """{"prompt" | "messages" | "prompt_token_ids": ..., "sampling_params": {...}}, or an
    OpenAI line's {"url": ..., "body": {...}}."""
    error: str | None = None
    openai: bool = False
    """An OpenAI batch line (it has a `body`), even one that cannot run."""

    @property
    def key(self) -> str:
        """The ID as a comparable string (how `--resume` recognises finished rows)."""
        return row_key(self.row_id)

    def to_record(self) -> dict[str, str]:
        """The item as a flat string record for a Ray dataset."""
        return {
            "item": json.dumps(
                {
                    "index": self.index,
                    "id_key": self.id_key,
                    "row_id": self.row_id,
                    "request": self.request,
                    "error": self.error,
                    "openai": self.openai,
                }
            )
        }

    @classmethod
    def from_record(cls, record: str) -> BatchItem:
        return cls(**json.loads(record))

    def error_row(self, message: str) -> dict[str, Any]:
        return {self.id_key: self.row_id, "error": message}


def row_key(row_id: object) -> str:
    return json.dumps(row_id)


def parse_line(index: int, line: str) -> BatchItem:
    """Line `index` of the input (0-based, blank lines counted) as a `BatchItem`."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        return BatchItem(index, "id", index, None, f"line {index + 1} is not valid JSON: {exc}")
    if not isinstance(data, dict):
        message = f"line {index + 1} must be a JSON object, got {type(data).__name__}"
        return BatchItem(index, "id", index, None, message)
    id_key = "custom_id" if "custom_id" in data else "id"
    row_id = data.get(id_key, index)
    openai = "body" in data
    try:
        if openai:
            request = _openai_request(data)
        else:
            request = _row_request(data)
            request["sampling_params"] = dataclasses.asdict(make_sampling_params(request))
    except (TypeError, ValueError) as exc:
        return BatchItem(index, id_key, row_id, None, str(exc), openai)
    return BatchItem(index, id_key, row_id, request, openai=openai)


def _row_request(data: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(data) - _ROW_KEYS)
    if unknown:
        raise ValueError(unknown_key_message(unknown[0], _ROW_KEYS | {"body"}, what="row key"))
    prompts = [key for key in _PROMPT_KEYS if key in data]
    if len(prompts) != 1:
        raise ValueError("a row needs exactly one of 'prompt', 'messages' or 'prompt_token_ids'")
    params = data.get("sampling_params", {})
    if not isinstance(params, dict):
        raise ValueError(f"sampling_params must be an object, got {type(params).__name__}")
    request = {prompts[0]: data[prompts[0]], "sampling_params": dict(params)}
    if data.get("lora_request") is not None:
        lora_request(data["lora_request"])  # checked now: a bad one fails only its row
        request["lora_request"] = data["lora_request"]
    return request


def lora_request(column: object) -> LoRARequest:
    """A row's `lora_request` column ({"lora_name": ..., "lora_path": ...}) as a `LoRARequest`."""
    if not isinstance(column, dict) or set(column) - {"lora_name", "lora_path", "lora_int_id"}:
        raise ValueError(
            f'lora_request must be an object {{"lora_name": ..., "lora_path": ...}}, got {column!r}'
        )
    return LoRARequest(
        lora_name=column.get("lora_name", ""),
        lora_int_id=int(column.get("lora_int_id", 0)),
        lora_path=column.get("lora_path", ""),
    )


def _openai_request(data: dict[str, Any]) -> dict[str, Any]:
    """{"url", "body"} of an OpenAI batch line, its body checked as the HTTP API checks it."""
    url, body = data.get("url", OPENAI_URLS[0]), data["body"]
    if url not in OPENAI_URLS:
        raise ValueError(f"url must be one of {', '.join(OPENAI_URLS)}, got {url!r}")
    if data.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {data.get('method')!r}")
    if not isinstance(body, dict):
        raise ValueError(f"body must be an object, got {type(body).__name__}")
    request = openai_request(url, body)
    to_sampling_params(request, request.max_tokens or 1)  # its sampling fields, checked now
    return {"url": url, "body": body}


def openai_request(url: str, body: dict[str, Any]) -> CompletionRequest | ChatCompletionRequest:
    """The body as the HTTP API's request model; ValueError naming the first bad field."""
    model = ChatCompletionRequest if url == "/v1/chat/completions" else CompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise ValueError(f"body: {format_validation_error(error)}") from None
    if request.stream:
        raise ValueError("stream must be false in batch runs")
    if request.n != 1:
        raise ValueError(
            f"n must be 1 in batch runs (one output row per input row), got {request.n}"
        )
    if isinstance(request, CompletionRequest) and len(request.prompts) != 1:
        raise ValueError("prompt must be one prompt in batch runs (one output row per line)")
    return request


def make_sampling_params(request: dict[str, Any]) -> SamplingParams:
    """The request's `SamplingParams` (vLLM names); ValueError naming a bad field."""
    params = dict(request["sampling_params"])
    for key in params:
        if key not in _PARAM_NAMES:
            raise ValueError(unknown_key_message(key, _PARAM_NAMES, what="sampling parameter"))
    if isinstance(params.get("stop_token_ids"), list):
        params["stop_token_ids"] = tuple(params["stop_token_ids"])
    if isinstance(params.get("structured_outputs"), dict):
        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    sampling = SamplingParams(**params)
    if sampling.n != 1:
        raise ValueError(
            f"n must be 1 in batch runs (one output row per input row), got {sampling.n}"
        )
    return sampling


def tool_call_column(request: dict[str, Any], text: str) -> list[dict[str, Any]] | None:
    """The `tool_calls` of an OpenAI chat line that offered tools, in the response's shape
    (None: not such a line)."""
    body = request.get("body")
    if request.get("url") != OPENAI_URLS[0] or not isinstance(body, dict) or not body.get("tools"):
        return None
    chat = openai_request(OPENAI_URLS[0], body)
    assert isinstance(chat, ChatCompletionRequest)
    calls = tool_call_plan(chat, None).extract(text).calls
    return [call.model_dump() for call in tool_calls(calls)]


def result_row(
    item: BatchItem, prompt_len: int, token_ids: list[int], text: str, reason: str | None
) -> dict[str, Any]:
    """The output row of a finished request (Ray Data LLM's column names)."""
    return {
        item.id_key: item.row_id,
        "generated_text": text,
        "generated_tokens": token_ids,
        "num_input_tokens": prompt_len,
        "num_generated_tokens": len(token_ids),
        "finish_reason": reason,
    }


def prompt_logprobs_column(
    positions: Sequence[Mapping[int, Any] | None],
) -> list[dict[str, dict[str, Any]] | None]:
    """The `prompt_logprobs` column of a row that asked for them (vLLM's shape, as JSON)."""
    return [
        None if position is None else {key: entry.model_dump() for key, entry in position.items()}
        for position in prompt_logprobs_body(positions)
    ]

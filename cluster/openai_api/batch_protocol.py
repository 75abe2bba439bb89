"""OpenAI's Batch API shapes: input lines, output lines, and the `file` and `batch` objects.

An input line is `{"custom_id", "method": "POST", "url", "body"}`; its body is checked with the
HTTP API's own request models, so a batch accepts and rejects what the server does (`stream`
false, `n` 1, one prompt). A line that cannot run becomes a `BatchLine` carrying its error, and
then an error output line: a bad line never fails its batch.

An output line is `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`: `body` is the full chat or completion response (usage included) when the request
succeeded; otherwise `body` is OpenAI's error body and `error` OpenAI's batch error object
(`code`, `message`, `line`). Every entry point writes this shape: the `/v1/batches` output and
error files, `hybridserve run-batch` and `ray job submit` batch runs.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from cluster.config.errors import format_validation_error
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest, ErrorInfo

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
BATCH_URLS = (CHAT_URL, COMPLETIONS_URL)
BATCH_PRIORITY = 100
"""Added to a batch line's `priority`: under the priority policy every interactive request
(priority 0 unless it says otherwise) is scheduled before waiting batch lines, and a batch
line is the first preempted."""

OpenAiRequest = ChatCompletionRequest | CompletionRequest


@dataclass(frozen=True)
class BatchLine:
    """One input line: its request, or why it cannot run."""

    index: int
    """0-based line number in the input file (blank lines counted)."""
    custom_id: str
    url: str
    body: dict[str, Any] | None
    error: str | None = None

    def request(self) -> OpenAiRequest:
        """The body as the HTTP API's request model (only for a line without error)."""
        assert self.body is not None
        return request_model(self.url, self.body)


def request_model(url: str, body: dict[str, Any]) -> OpenAiRequest:
    """The body as the HTTP API's request model; ValueError naming the first bad field, or a
    field a batch line cannot use (streaming, several answers)."""
    model = ChatCompletionRequest if url == CHAT_URL else CompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise ValueError(f"body: {format_validation_error(error)}") from None
    if request.stream:
        raise ValueError("stream must be false in batch runs")
    if request.n != 1:
        raise ValueError(
            f"n must be 1 in batch runs (one output line per input line), got {request.n}"
        )
    if isinstance(request, CompletionRequest) and len(request.prompts) != 1:
        raise ValueError("prompt must be one prompt in batch runs (one output line per line)")
    return request


def parse_batch_line(index: int, text: str, endpoint: str | None = None) -> BatchLine:
    """Line `index` of a batch input; `endpoint`: the one URL the batch allows (None: either)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return BatchLine(
            index, f"line-{index + 1}", "", None, f"line {index + 1} is not valid JSON: {exc}"
        )
    if not isinstance(data, dict):
        kind = type(data).__name__
        return BatchLine(
            index,
            f"line-{index + 1}",
            "",
            None,
            f"line {index + 1} must be a JSON object, got {kind}",
        )
    custom_id = str(data.get("custom_id", f"line-{index + 1}"))
    url = data.get("url")
    try:
        _check_envelope(data, endpoint)
        request_model(str(url), data["body"])
    except ValueError as exc:
        return BatchLine(index, custom_id, str(url or ""), None, str(exc))
    return BatchLine(index, custom_id, str(url), data["body"])


def _check_envelope(data: dict[str, Any], endpoint: str | None) -> None:
    if "custom_id" not in data:
        raise ValueError("custom_id is required")
    url = data.get("url")
    allowed = (endpoint,) if endpoint is not None else BATCH_URLS
    if url not in allowed:
        raise ValueError(f"url must be {' or '.join(allowed)}, got {url!r}")
    if data.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, got {data.get('method')!r}")
    if not isinstance(data.get("body"), dict):
        raise ValueError(f"body must be an object, got {type(data.get('body')).__name__}")


def non_jsonl_reason(content: bytes) -> str | None:
    """Why a file is not a batch input at all (not UTF-8, no lines, no line a JSON object);
    None for a JSONL file, even one with some malformed lines (those become error lines)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"the file is not UTF-8 text: {exc}"
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return "the file has no lines: a batch input is JSONL, one request object per line"
    for line in lines:
        try:
            if isinstance(json.loads(line), dict):
                return None
        except json.JSONDecodeError:
            continue
    return (
        "no line of the file is a JSON object: a batch input is JSONL, one request object per line"
    )


def read_batch_lines(content: str, endpoint: str | None = None) -> list[BatchLine]:
    """Every non-blank line of an input file; a repeated custom_id is an error line."""
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for index, text in enumerate(content.splitlines()):
        if not text.strip():
            continue
        line = parse_batch_line(index, text, endpoint)
        if line.error is None and line.custom_id in seen:
            line = BatchLine(
                index, line.custom_id, line.url, None, f"duplicate custom_id {line.custom_id!r}"
            )
        seen.add(line.custom_id)
        lines.append(line)
    return lines


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def success_line(custom_id: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """The output line of a request that answered 200 with `body`."""
    response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": new_id("batch_req"), "custom_id": custom_id, "response": response, "error": None}


def failure_line(
    custom_id: str,
    request_id: str,
    error: ErrorInfo,
    status_code: int,
    line: int | None = None,
) -> dict[str, Any]:
    """The output line of a request that failed: its HTTP status and OpenAI error body, and
    OpenAI's batch error object (`line`: 1-based input line, for lines that could not run)."""
    response = {
        "status_code": status_code,
        "request_id": request_id,
        "body": {"error": error.model_dump()},
    }
    code = str(error.code) if error.code is not None else error.type
    batch_error = {"code": code, "message": error.message, "param": error.param, "line": line}
    return {
        "id": new_id("batch_req"),
        "custom_id": custom_id,
        "response": response,
        "error": batch_error,
    }


def invalid_line(line: BatchLine, request_id: str) -> dict[str, Any]:
    """The error line of an input line that could not become a request."""
    info = ErrorInfo(
        message=line.error or "invalid line", type="invalid_request_error", code="invalid_request"
    )
    return failure_line(line.custom_id, request_id, info, 400, line.index + 1)


def is_success(output_line: dict[str, Any]) -> bool:
    return output_line.get("error") is None


def now() -> int:
    return int(time.time())


# -- the `file` and `batch` objects -------------------------------------------------------------

FilePurpose = Literal["batch", "batch_output"]
BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
TERMINAL_STATUSES = ("failed", "completed", "expired", "cancelled")
COMPLETION_WINDOWS = {"24h": 24 * 3600}


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject] = Field(default_factory=list)
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreateRequest(BaseModel):
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorItem(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem] = Field(default_factory=list)


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus = "validating"
    created_at: int
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_STATUSES


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject] = Field(default_factory=list)
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

"""OpenAI batch output lines of a Ray Data batch run (`--output-format openai`).

An OpenAI input line (`{"custom_id", "url", "body"}`) comes back as OpenAI's batch output line,
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, built by the
one line builder (`cluster.openai_api.batch_protocol`) around the body the Serve replica would
answer (`cluster.serve.formatting.response_formatter`): the same lines as `/v1/batches` and
`hybridserve run-batch`. Ray Data LLM rows keep their columns in either format.
"""

from __future__ import annotations

from typing import Any, Literal

from cluster.batch.rows import BatchItem
from cluster.engine.outputs import RequestOutput
from cluster.openai_api.batch_protocol import failure_line, success_line
from cluster.serve import errors
from cluster.serve.formatting import ChatFormatter, CompletionFormatter

OutputFormat = Literal["openai", "columns"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = ("openai", "columns")
Formatter = ChatFormatter | CompletionFormatter


def writes_openai_line(item: BatchItem, output_format: OutputFormat) -> bool:
    """Whether `item`'s output is an OpenAI batch line (an OpenAI input line, openai format; a
    line that is not JSON at all keeps the column format's error row)."""
    return output_format == "openai" and item.openai


def request_id(item: BatchItem) -> str:
    return f"batch-{item.index}"


def answer_line(item: BatchItem, formatter: Formatter, output: RequestOutput) -> dict[str, Any]:
    """The output line of a line the engine answered: the response body, usage included."""
    body = formatter.response(output).model_dump(mode="json")
    return success_line(item.row_id, request_id(item), body)


def error_line(item: BatchItem, message: str, status: int = 400) -> dict[str, Any]:
    """The output line of a line that could not run (400) or failed in the engine (500)."""
    error = errors.error_response(message, status)
    line = item.index + 1 if status == 400 else None
    return failure_line(item.row_id, request_id(item), error.error, status, line)

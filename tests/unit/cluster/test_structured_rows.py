"""Structured outputs in batch rows: the constraint survives the row record, and OpenAI chat
lines that offer tools get a `tool_calls` column."""

from __future__ import annotations

import json

from cluster.batch.rows import BatchItem, make_sampling_params, parse_line, tool_call_column
from scheduler.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_rows_constraint_survives_its_record() -> None:
    line = json.dumps(
        {"id": 1, "prompt": "x", "sampling_params": {"structured_outputs": {"json": SCHEMA}}}
    )
    item = BatchItem.from_record(parse_line(0, line).to_record()["item"])
    assert item.error is None
    assert item.request is not None
    params = make_sampling_params(item.request)
    assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA)


def test_a_bad_constraint_is_an_error_row() -> None:
    line = json.dumps({"prompt": "x", "sampling_params": {"structured_outputs": {"rgx": "a"}}})
    assert parse_line(0, line).error is not None


def test_chat_lines_with_tools_get_tool_calls() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools}
    request = {"url": "/v1/chat/completions", "body": body}
    text = 'ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    (call,) = tool_call_column(request, text) or []
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert call["type"] == "function"
    assert tool_call_column({"url": "/v1/chat/completions", "body": {"messages": []}}, "x") is None

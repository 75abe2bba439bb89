"""Llama 3.x JSON tool calls: the reply is `{"name": ..., "parameters": {...}}` (several joined
by `;`), optionally after `<|python_tag|>`."""

from __future__ import annotations

from cluster.openai_api.tool_parsers.base import ParsedOutput, call_of, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    start_markers: tuple[str, ...] = (PYTHON_TAG, '{"name"', '{ "name"')

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        if not body.lstrip().startswith("{"):
            return ParsedOutput(text)
        calls = [call_of(value, "parameters") for value in json_values(body)]
        if not calls or any(call is None for call in calls):
            return ParsedOutput(text)
        return ParsedOutput(None, [call for call in calls if call is not None])

"""Mistral: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers), or one
`name[ARGS]{...}` per call (v11+ tokenizers)."""

from __future__ import annotations

import json
import re

from cluster.openai_api.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    call_of,
    content_or_none,
    json_values,
)

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\[ARGS\]")


class MistralToolParser:
    start_markers: tuple[str, ...] = (TOOL_CALLS,)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return ParsedOutput(text)
        calls: list[ParsedToolCall] = []
        for segment in text[start:].split(TOOL_CALLS)[1:]:
            calls.extend(_segment_calls(segment))
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput(content_or_none(text[:start]), calls)


def _segment_calls(segment: str) -> list[ParsedToolCall]:
    named = _NAMED.match(segment.strip())
    if named is not None:
        values = json_values(segment.strip()[named.end() :])
        return [ParsedToolCall(named.group(1), _json_text(values[0]))] if values else []
    calls = []
    for value in json_values(segment):
        for item in value if isinstance(value, list) else [value]:
            call = call_of(item)
            if call is not None:
                calls.append(call)
    return calls


def _json_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)

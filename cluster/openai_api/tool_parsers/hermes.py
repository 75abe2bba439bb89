"""Hermes and Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

from __future__ import annotations

import re

from cluster.openai_api.tool_parsers.base import (
    ParsedOutput,
    call_of,
    content_or_none,
    json_values,
)

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser:
    start_markers: tuple[str, ...] = ("<tool_call>",)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text)
        calls = []
        for block in _BLOCK.findall(text[start:]):
            for value in json_values(block):
                call = call_of(value)
                if call is not None:
                    calls.append(call)
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput(content_or_none(text[:start]), calls)

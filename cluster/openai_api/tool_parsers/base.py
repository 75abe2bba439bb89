"""What a tool-call parser returns, and helpers the parsers share."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str
    """JSON text."""


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    """Text outside the tool calls (None: none)."""
    calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(Protocol):
    start_markers: tuple[str, ...]
    """Text that opens the tool calls: a stream holds its text back from there on."""

    def parse(self, text: str) -> ParsedOutput: ...


def json_values(text: str) -> list[Any]:
    """The JSON values written one after another in `text` (separators `,` `;` and whitespace
    between them are skipped); stops at the first text that is not JSON."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    position = 0
    while True:
        while position < len(text) and text[position] in " \t\r\n,;":
            position += 1
        if position >= len(text):
            return values
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return values
        values.append(value)


def call_of(value: object, arguments_key: str = "arguments") -> ParsedToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` as a call (None: not that shape)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("parameters", value.get("arguments", {})))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ParsedToolCall(value["name"], text)


def content_or_none(text: str) -> str | None:
    stripped = text.strip()
    return stripped or None

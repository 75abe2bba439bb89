"""`tools` + `tool_choice` -> how the reply is constrained and read.

    none      tools are shown to the model; the reply is text
    auto      the reply is read by the model family's tool parser (calls and/or text)
    required  the reply is a grammar-enforced JSON list of {"name", "parameters"} objects, one of
              the tools each (one item only when `parallel_tool_calls` is false)
    named     the reply is a grammar-enforced JSON object of that function's parameters

so `required` and named calls always parse into valid arguments for the function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from cluster.openai_api.protocol import ChatCompletionRequest
from cluster.openai_api.tool_models import ChatTool, NamedToolChoice
from cluster.openai_api.tool_parsers import (
    DEFAULT_TOOL_PARSER,
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
    get_tool_parser,
)

Mode = Literal["none", "auto", "required", "named"]
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolCallPlan:
    """How one request's reply is read."""

    mode: Mode
    function: str | None = None
    """The named function (mode `named`)."""
    parser: ToolParser | None = None
    """The family's parser (mode `auto`)."""

    def extract(self, text: str) -> ParsedOutput:
        """The reply's content and tool calls."""
        if self.mode == "named":
            assert self.function is not None
            return ParsedOutput(None, [ParsedToolCall(self.function, text.strip())])
        if self.mode == "required":
            return _required_calls(text)
        if self.mode == "auto" and self.parser is not None:
            return self.parser.parse(text)
        return ParsedOutput(text)

    def held_from(self, text: str) -> int:
        """Where a stream stops showing `text` as content: the start of a tool call, or of a
        partial start marker at its end (len(text): nothing held)."""
        if self.mode in ("named", "required"):
            return 0
        if self.mode != "auto" or self.parser is None:
            return len(text)
        markers = self.parser.start_markers
        found = [i for i in (text.find(marker) for marker in markers) if i >= 0]
        if found:
            return min(found)
        for start in range(max(0, len(text) - max(map(len, markers)) + 1), len(text)):
            if any(marker.startswith(text[start:]) for marker in markers):
                return start
        return len(text)


def tool_call_plan(request: ChatCompletionRequest, parser_name: str | None) -> ToolCallPlan:
    """The request's plan; ValueError for a tool_choice that names no given tool."""
    tools = request.tools or []
    choice = (
        request.tool_choice if request.tool_choice is not None else ("auto" if tools else "none")
    )
    if isinstance(choice, NamedToolChoice):
        _function(tools, choice.function.name)
        return ToolCallPlan("named", function=choice.function.name)
    if choice != "none" and not tools:
        raise ValueError(f'tool_choice "{choice}" needs tools')
    if choice == "auto":
        return ToolCallPlan("auto", parser=get_tool_parser(parser_name or DEFAULT_TOOL_PARSER))
    return ToolCallPlan(choice)


def tool_schema(request: ChatCompletionRequest, plan: ToolCallPlan) -> dict[str, Any] | None:
    """The JSON schema a `required` or named reply must follow (None: unconstrained)."""
    tools = request.tools or []
    if plan.mode == "named":
        assert plan.function is not None
        return _function(tools, plan.function).function.parameters or ANY_OBJECT
    if plan.mode != "required":
        return None
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not request.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def tool_dicts(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as the chat template receives them."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def _function(tools: list[ChatTool], name: str) -> ChatTool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")


def _required_calls(text: str) -> ParsedOutput:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return ParsedOutput(text)
    calls = (
        [
            ParsedToolCall(item["name"], json.dumps(item.get("parameters", {})))
            for item in items
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
        if isinstance(items, list)
        else []
    )
    return ParsedOutput(None, calls) if calls else ParsedOutput(text)

"""Tool calls in OpenAI's response shapes: a message's `tool_calls`, and a stream that shows
content until a tool call starts, then sends each call as one `delta.tool_calls` entry when
the reply ends (index, id, type, name and the whole arguments)."""

from __future__ import annotations

import uuid

from cluster.openai_api.tool_models import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from cluster.openai_api.tool_parsers import ParsedToolCall
from cluster.openai_api.tools import ToolCallPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [
        ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's `tool_calls` for a reply that ended normally with calls."""
    return "tool_calls" if has_calls and reason == "stop" else reason


class ToolCallStream:
    """One choice's streamed reply under a tool-call plan."""

    def __init__(self, plan: ToolCallPlan) -> None:
        self.plan = plan
        self.text = ""
        self.shown = 0
        """Characters of `text` sent as content."""

    def feed(self, delta: str) -> str:
        """The content to send now for `delta` (text that may start a tool call is held)."""
        self.text += delta
        return self._show(self.plan.held_from(self.text))

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """The rest of the content and the tool calls, when the reply has ended."""
        parsed = self.plan.extract(self.text)
        if not parsed.calls:
            return self._show(len(self.text)), []
        rest = self._show(self.plan.held_from(self.text))
        deltas = [
            DeltaToolCall(
                index=index,
                id=call_id(),
                type="function",
                function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
            )
            for index, call in enumerate(parsed.calls)
        ]
        return rest, deltas

    def _show(self, end: int) -> str:
        if end <= self.shown:
            return ""
        content = self.text[self.shown : end]
        self.shown = end
        return content

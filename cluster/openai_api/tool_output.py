"""Tool calls in OpenAI's response shapes: a message's `tool_calls`, and a stream. In a stream a
named tool choice sends its call's id and name first, then the arguments as they are generated;
otherwise content is shown until a tool call starts, and each call is sent as one
`delta.tool_calls` entry when the reply ends (index, id, type, name and the whole arguments)."""

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
        self.made_calls = False
        """Tool calls were sent (the finish reason is then `tool_calls`)."""

    def feed(self, delta: str) -> tuple[str, list[DeltaToolCall]]:
        """The content and tool-call pieces to send now for `delta` (text that may start a tool
        call is held)."""
        self.text += delta
        if self.plan.mode == "named":
            return "", self._named_piece(delta)
        return self._show(self.plan.held_from(self.text)), []

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """The rest of the content and the tool calls, when the reply has ended."""
        if self.plan.mode == "named":
            return "", []
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
        self.made_calls = True
        return rest, deltas

    def _named_piece(self, delta: str) -> list[DeltaToolCall]:
        if self.made_calls:
            return (
                [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
                if delta
                else []
            )
        self.made_calls = True
        function = DeltaFunctionCall(name=self.plan.function, arguments=delta)
        return [DeltaToolCall(index=0, id=call_id(), type="function", function=function)]

    def _show(self, end: int) -> str:
        if end <= self.shown:
            return ""
        content = self.text[self.shown : end]
        self.shown = end
        return content

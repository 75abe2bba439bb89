"""OpenAI's bodies for structured outputs and tool calling: `response_format`, `tools`,
`tool_choice`, and the `tool_calls` of a message or of a streamed delta."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    """`{"type": "function", "function": {"name": ...}}`: this function must be called."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's shape)."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One tool call, or a piece of one, in a streamed chunk (`index` says which)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

"""The output constraint of an OpenAI request: `response_format`, vLLM's `structured_outputs`
extra body, or a `required` / named `tool_choice` (at most one of them)."""

from __future__ import annotations

from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.openai_api.tools import tool_call_plan, tool_schema
from scheduler.structured_outputs import StructuredOutputsParams


def request_constraint(
    request: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """ValueError (a 400) for a malformed or contradictory constraint."""
    found: dict[str, StructuredOutputsParams] = {}
    if request.structured_outputs:
        try:
            found["structured_outputs"] = StructuredOutputsParams(**request.structured_outputs)
        except TypeError as error:
            raise ValueError(f"structured_outputs: {error}") from None
    response_format = request.response_format
    if response_format is not None and response_format.type == "json_object":
        found["response_format"] = StructuredOutputsParams(json_object=True)
    elif response_format is not None and response_format.type == "json_schema":
        spec = response_format.json_schema
        if spec is None or spec.json_schema is None:
            raise ValueError('response_format "json_schema" needs json_schema.schema')
        found["response_format"] = StructuredOutputsParams(json=spec.json_schema)
    if isinstance(request, ChatCompletionRequest) and (request.tools or request.tool_choice):
        schema = tool_schema(request, tool_call_plan(request, None))
        if schema is not None:
            found["tool_choice"] = StructuredOutputsParams(json=schema)
    if len(found) > 1:
        raise ValueError(f"set only one of {' and '.join(found)}: both constrain the output")
    return next(iter(found.values()), None)

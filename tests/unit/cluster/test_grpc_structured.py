"""gRPC carries response_format, structured_outputs, tools and tool_choice as protobuf Structs
into the same request models as HTTP, and tool calls back in `ChatDelta.tool_calls`."""

from __future__ import annotations

import json

from google.protobuf import json_format

from cluster.openai_api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
)
from cluster.openai_api.sampling import to_sampling_params
from cluster.openai_api.tool_models import FunctionCall, ToolCall
from cluster.serve.grpc import llm_pb2
from cluster.serve.grpc.methods import _request_dict, _to_proto

PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}}


def test_tools_and_a_named_choice_become_the_same_constraint_as_over_http() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": PARAMETERS}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    message = json_format.ParseDict(body, llm_pb2.ChatCompletionRequest())
    request = ChatCompletionRequest.model_validate(_request_dict(message, stream=False))
    constraint = to_sampling_params(request, 16).structured_outputs
    assert constraint is not None
    assert constraint.json is not None
    assert json.loads(constraint.json) == PARAMETERS  # 5, not 5.0 (a Struct keeps no key order)
    assert json.loads(constraint.json)["properties"]["a"]["maximum"].__class__ is int


def test_structured_outputs_of_a_completion() -> None:
    body = {"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}
    message = json_format.ParseDict(body, llm_pb2.CompletionRequest())
    assert _request_dict(message, stream=False)["structured_outputs"] == {"choice": ["a", "b"]}


def test_tool_calls_come_back_in_the_message() -> None:
    call = ToolCall(id="call_1", function=FunctionCall(name="f", arguments='{"a": 1}'))
    response = ChatCompletionResponse(
        id="r",
        model="m",
        choices=[ChatChoice(index=0, message=ChatResponseMessage(tool_calls=[call]))],
    )
    proto = _to_proto(response, llm_pb2.ChatCompletionResponse)
    (got,) = proto.choices[0].message.tool_calls
    assert (got.id, got.function.name, got.function.arguments) == ("call_1", "f", '{"a": 1}')

"""The gRPC methods of the ingress (`hybridserve.v1.LLMService`, through Serve's gRPC proxy).

Each RPC name is a method here; requests become the same pydantic models the HTTP routes use,
so validation and errors are shared. Errors go out as gRPC status codes (INVALID_ARGUMENT,
NOT_FOUND, UNAUTHENTICATED, UNAVAILABLE) with OpenAI's message as the details.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from pydantic import BaseModel, ValidationError

from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from cluster.serve import errors

llm_pb2: Any = importlib.import_module("cluster.serve.grpc.llm_pb2")
"""The generated messages (untyped: protoc builds them at import)."""

if TYPE_CHECKING:
    from ray.serve.grpc_util import RayServegRPCContext

    from cluster.openai_api.protocol import ModelList


class GrpcRequestError(Exception):
    """Ends an RPC with the status code set on its context (Serve sends code and details)."""


def _fail(context: RayServegRPCContext, error: ErrorResponse) -> GrpcRequestError:
    context.set_code(grpc.StatusCode[errors.GRPC_CODE_NAMES.get(error.status, "INTERNAL")])
    context.set_details(error.error.message)
    return GrpcRequestError(error.error.message)


def _to_proto(body: BaseModel, message_cls: type[Message]) -> Any:
    data = body.model_dump(exclude_none=True)
    return json_format.ParseDict(data, message_cls(), ignore_unknown_fields=True)


_JSON_FIELDS = ("response_format", "structured_outputs", "tools", "tool_choice")
"""Fields carried as protobuf Structs, whose numbers all arrive as floats."""


def _integral(value: Any) -> Any:
    """JSON from a Struct with integral floats as ints (a schema's `maxLength: 8`, not 8.0)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value


def _request_dict(message: Message, stream: bool) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    data.pop("request_id", None)
    for name in _JSON_FIELDS:
        if name in data:
            data[name] = _integral(data[name])
    if "prompt_token_ids" in data:
        data["prompt"] = data.pop("prompt_token_ids")
    for message in data.get("messages", []):
        if "content_parts" in message:  # OpenAI's list of parts (text, image_url)
            message["content"] = message.pop("content_parts")
    data["stream"] = stream
    return data


class GrpcMethods:
    """Mixed into `OpenAiIngress`, which provides `check_api_key`, `start` and `models`."""

    if TYPE_CHECKING:

        def check_api_key(self, authorization: str | None) -> ErrorResponse | None: ...

        async def start(
            self,
            request: CompletionRequest | ChatCompletionRequest,
            request_id: str,
            as_sse: bool,
        ) -> tuple[Any, AsyncIterator[Any] | None]: ...

        async def models(self) -> ModelList: ...

    async def _grpc_start(
        self,
        message: Message,
        context: RayServegRPCContext,
        request_cls: type[CompletionRequest] | type[ChatCompletionRequest],
        stream: bool,
    ) -> tuple[Any, AsyncIterator[Any] | None]:
        metadata = context.invocation_metadata()
        meta = dict(metadata)
        denied = self.check_api_key(meta.get("authorization"))
        if denied is not None:
            return denied, None
        request_id = getattr(message, "request_id", "") or meta.get("request_id") or ""
        try:
            request = request_cls.model_validate(_request_dict(message, stream))
        except ValidationError as error:
            return errors.from_validation_error(error), None
        return await self.start(request, request_id or uuid.uuid4().hex, as_sse=False)

    async def _unary(
        self,
        message: Message,
        context: RayServegRPCContext,
        request_cls: type[CompletionRequest] | type[ChatCompletionRequest],
        response_cls: type[Message],
    ) -> Any:
        first, _ = await self._grpc_start(message, context, request_cls, stream=False)
        if isinstance(first, ErrorResponse):
            raise _fail(context, first)
        return _to_proto(first, response_cls)

    async def _stream(
        self,
        message: Message,
        context: RayServegRPCContext,
        request_cls: type[CompletionRequest] | type[ChatCompletionRequest],
        response_cls: type[Message],
    ) -> AsyncIterator[Any]:
        first, rest = await self._grpc_start(message, context, request_cls, stream=True)
        if isinstance(first, ErrorResponse):
            raise _fail(context, first)
        yield _to_proto(first, response_cls)
        if rest is not None:
            async for chunk in rest:
                if isinstance(chunk, ErrorResponse):  # the engine failed mid-stream
                    raise _fail(context, chunk)
                yield _to_proto(chunk, response_cls)

    async def Completion(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary(
            request, grpc_context, CompletionRequest, llm_pb2.CompletionResponse
        )

    async def CompletionStream(
        self, request: Any, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[Any]:
        async for chunk in self._stream(
            request, grpc_context, CompletionRequest, llm_pb2.CompletionResponse
        ):
            yield chunk

    async def ChatCompletion(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary(
            request, grpc_context, ChatCompletionRequest, llm_pb2.ChatCompletionResponse
        )

    async def ChatCompletionStream(
        self, request: Any, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[Any]:
        async for chunk in self._stream(
            request, grpc_context, ChatCompletionRequest, llm_pb2.ChatCompletionResponse
        ):
            yield chunk

    async def ListModels(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        meta = dict(grpc_context.invocation_metadata())
        denied = self.check_api_key(meta.get("authorization"))
        if denied is not None:
            raise _fail(grpc_context, denied)
        models = await self.models()
        return llm_pb2.ListModelsResponse(
            models=[
                llm_pb2.ModelInfo(id=card.id, max_model_len=card.max_model_len or 0)
                for card in models.data
            ]
        )

"""OpenAI request and response bodies as pydantic models (the HTTP and gRPC surface).

Requests accept the OpenAI fields plus vLLM's extensions (`top_k`, `min_p`, `ignore_eos`,
`min_tokens`, ...); unknown fields are ignored, as OpenAI's server does. Range checks that
depend on the engine (vocabulary, context length) happen in the LLM server, not here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from typing_extensions import Required, TypedDict

from cluster.openai_api.tool_models import (
    ChatTool,
    DeltaToolCall,
    ResponseFormat,
    ToolCall,
    ToolChoice,
)

MAX_TOP_LOGPROBS = 20


logger = logging.getLogger(__name__)


class _Request(BaseModel):
    """Unknown fields are ignored with a warning naming them (vLLM does the same)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - _known_names(cls))
            if unknown:
                logger.warning("request fields ignored (not supported): %s", ", ".join(unknown))
        return data


def _known_names(model: type[BaseModel]) -> set[str]:
    names = set(model.model_fields)
    names.update(f.alias for f in model.model_fields.values() if f.alias)
    return names


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


_STOP_TEXT = {"type": "string", "minLength": 1}
StopField = Annotated[
    str | list[str] | None,
    Field(None),
    WithJsonSchema(
        {
            "anyOf": [_STOP_TEXT, {"type": "array", "items": _STOP_TEXT}, {"type": "null"}],
            "title": "Stop",
        }
    ),
]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]+$")]
"""A token ID as a JSON object key (`logit_bias`)."""
_LOGIT_BIAS = {
    "anyOf": [
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {"type": "number"},
        },
        {"type": "null"},
    ],
    "title": "Logit Bias",
}


class SamplingFields(_Request):
    """The sampling fields completions and chat share (OpenAI names, vLLM extensions)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2**16)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: StopField = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: Annotated[dict[TokenIdKey, float] | None, WithJsonSchema(_LOGIT_BIAS)] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's extra body: {"json" | "regex" | "choice" | "grammar" | ...: ...}."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    """vLLM's extra field: the logprob of every prompt token (and this many alternatives)."""

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(not s for s in strings):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = list[Annotated[int, Field(ge=0)]]
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {
    "anyOf": [
        _TEXT,
        {"type": "array", "items": _TEXT, "minItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ],
    "title": "Prompt",
}
"""The prompt as documented: what `_check_prompt` lets through (never empty)."""


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"model": "my-model", "prompt": "Say this is a test", "max_tokens": 7},
                {"model": "my-model", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True},
            ]
        }
    )

    prompt: Annotated[str | list[str] | TokenIds | list[TokenIds], WithJsonSchema(_PROMPT_SCHEMA)]
    """One prompt (text or token IDs), or a batch of them: one choice per prompt (times `n`)."""
    max_tokens: int | None = Field(16, ge=0)
    """0 only with `echo`: the prompt is scored, nothing is generated."""
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and isinstance(value[0], str | list):
            if any(not one for one in value):
                raise ValueError("prompt must not be empty")
            if len(value) == 1:
                return value[0]
        return value

    @model_validator(mode="after")
    def _check_max_tokens(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch."""
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str | list):
            return list(self.prompt)
        return [self.prompt]  # type: ignore[list-item]


class ImageUrl(TypedDict, total=False):
    """OpenAI's `image_url` object: a data:image/...;base64, http(s):// or file:// URL."""

    url: Required[str]
    detail: Literal["auto", "low", "high"]


class ContentPart(TypedDict, total=False):
    """A part of a message's content: `{"type": "text", "text": ...}` or
    `{"type": "image_url", "image_url": {"url": ...}}`."""

    type: str
    text: str
    image_url: ImageUrl


class ChatMessage(TypedDict, total=False):
    """One message; a dict, so routers that read `messages` see plain data."""

    role: Required[Literal["system", "user", "assistant", "tool", "developer"]]
    content: str | list[ContentPart] | None
    name: str
    tool_calls: list[dict[str, Any]]
    tool_call_id: str


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "model": "my-model",
                    "messages": [{"role": "user", "content": "Hello!"}],
                    "max_completion_tokens": 8,
                },
                {
                    "model": "my-model",
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"},
                    ],
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            ]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    """None: "auto" when tools are given, else "none"."""
    parallel_tool_calls: bool = True


class UsageDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: UsageDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry at one prompt position, as vLLM returns `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""Per prompt position (the first is None): token ID (as a string) -> its entry."""


def prompt_logprobs_body(positions: Sequence[Mapping[int, Any] | None]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` from the engine's positions (token ID -> an entry with
    `logprob`, `rank` and `decoded_token`)."""
    return [
        None
        if position is None
        else {
            str(token_id): PromptLogprob(
                logprob=entry.logprob, rank=entry.rank, decoded_token=entry.decoded_token
            )
            for token_id, entry in position.items()
        }
        for position in positions
    ]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    """A completion, or (with `object` unchanged, as OpenAI does) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """vLLM's place for the prompt's logprobs in a chat response (one prompt per request)."""


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """In the first chunk with choices once the prompt's logprobs are complete."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "hybridserve"
    root: str | None = None
    parent: str | None = None
    """A LoRA adapter's base model (None for a base model)."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body; `status` (not serialized) is the HTTP status it goes out with."""

    error: ErrorInfo
    status: int = Field(400, exclude=True)

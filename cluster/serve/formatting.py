"""Engine outputs -> OpenAI bodies: whole responses, SSE chunks and usage.

One formatter per request turns the engine's `RequestOutput` deltas into the chunks of a stream
(`data: {json}` lines) or, from the cumulative output, one response body.
"""

from __future__ import annotations

from pydantic import BaseModel

from cluster.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from cluster.openai_api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
    UsageDetails,
)
from cluster.openai_api.tool_output import ToolCallStream, finish_reason, tool_calls
from cluster.openai_api.tools import ToolCallPlan

DONE = "data: [DONE]\n\n"


def sse(body: BaseModel) -> str:
    """One server-sent event carrying `body` as JSON."""
    return f"data: {body.model_dump_json()}\n\n"


def usage_of(output: RequestOutput, completion_tokens: int) -> Usage:
    prompt_tokens = len(output.prompt_token_ids)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=UsageDetails(cached_tokens=output.num_cached_tokens),
    )


def _chosen(position: PositionLogprobs, token_id: int) -> tuple[str, float]:
    entry = position[token_id]
    return entry.decoded_token or "", entry.logprob


def _top(position: PositionLogprobs, token_id: int) -> list[tuple[str, float]]:
    """The top alternatives at one position, most likely first (the chosen one if ranked)."""
    ranked = sorted(
        ((lp.rank or 0, tid, lp) for tid, lp in position.items() if tid != token_id or lp.rank),
        key=lambda item: item[0],
    )
    return [(lp.decoded_token or "", lp.logprob) for _, _, lp in ranked]


def completion_logprobs(part: CompletionOutput, offset: int) -> CompletionLogprobs | None:
    if part.logprobs is None:
        return None
    result = CompletionLogprobs()
    for token_id, position in zip(part.token_ids, part.logprobs, strict=False):
        text, logprob = _chosen(position, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(dict(_top(position, token_id)))
        result.text_offset.append(offset)
        offset += len(text)
    return result


def chat_logprobs(part: CompletionOutput, num_top: int) -> ChatLogprobs | None:
    if part.logprobs is None:
        return None
    content = []
    for token_id, position in zip(part.token_ids, part.logprobs, strict=False):
        text, logprob = _chosen(position, token_id)
        top = [
            TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
            for t, lp in _top(position, token_id)[:num_top]
        ]
        content.append(
            TokenLogprob(token=text, logprob=logprob, bytes=list(text.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


class CompletionFormatter:
    """`/v1/completions` bodies of one request."""

    def __init__(self, response_id: str, model: str, echo_text: str | None) -> None:
        self.response_id = response_id
        self.model = model
        self.echo_text = echo_text
        self._echoed: set[int] = set()
        self._offsets: dict[int, int] = {}

    def _text(self, part: CompletionOutput) -> str:
        if self.echo_text is None or part.index in self._echoed:
            return part.text
        self._echoed.add(part.index)
        return self.echo_text + part.text

    def _choice(self, part: CompletionOutput) -> CompletionChoice:
        offset = self._offsets.get(part.index, 0)
        text = self._text(part)
        self._offsets[part.index] = offset + len(text)
        return CompletionChoice(
            index=part.index,
            text=text,
            logprobs=completion_logprobs(part, offset),
            finish_reason=part.finish_reason,
            stop_reason=part.stop_reason,
        )

    def chunk(self, delta: RequestOutput) -> CompletionResponse | None:
        choices = [self._choice(part) for part in delta.outputs]
        if not choices:
            return None
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices)

    def usage_chunk(self, output: RequestOutput, completion_tokens: int) -> CompletionResponse:
        usage = usage_of(output, completion_tokens)
        return CompletionResponse(id=self.response_id, model=self.model, choices=[], usage=usage)

    def response(self, output: RequestOutput) -> CompletionResponse:
        choices = [self._choice(part) for part in output.outputs]
        completion_tokens = sum(len(part.token_ids) for part in output.outputs)
        return CompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=usage_of(output, completion_tokens),
        )


class ChatFormatter:
    """`/v1/chat/completions` bodies of one request."""

    def __init__(
        self,
        response_id: str,
        model: str,
        num_top_logprobs: int,
        tools: ToolCallPlan | None = None,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.num_top = num_top_logprobs
        self.tools = tools
        """How tool calls are read from the reply (None: plain text)."""
        self._started: set[int] = set()
        self._tool_streams: dict[int, ToolCallStream] = {}

    def _choice(self, part: CompletionOutput) -> ChatChunkChoice:
        role = None
        if part.index not in self._started:
            self._started.add(part.index)
            role = "assistant"
        delta = DeltaMessage(role=role, content=part.text)
        reason = part.finish_reason
        if self.tools is not None:
            stream = self._tool_streams.setdefault(part.index, ToolCallStream(self.tools))
            delta.content, calls = stream.feed(part.text)
            if part.finished:
                rest, final_calls = stream.finish()
                delta.content += rest
                calls += final_calls
                reason = finish_reason(reason, stream.made_calls)
            delta.tool_calls = calls or None
        return ChatChunkChoice(
            index=part.index,
            delta=delta,
            logprobs=chat_logprobs(part, self.num_top),
            finish_reason=reason,
            stop_reason=part.stop_reason,
        )

    def _message(self, part: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        if self.tools is None:
            return ChatResponseMessage(content=part.text), part.finish_reason
        parsed = self.tools.extract(part.text)
        message = ChatResponseMessage(content=parsed.content, tool_calls=tool_calls(parsed.calls))
        return message, finish_reason(part.finish_reason, bool(parsed.calls))

    def chunk(self, delta: RequestOutput) -> ChatCompletionChunk | None:
        choices = [self._choice(part) for part in delta.outputs]
        if not choices:
            return None
        return ChatCompletionChunk(id=self.response_id, model=self.model, choices=choices)

    def usage_chunk(self, output: RequestOutput, completion_tokens: int) -> ChatCompletionChunk:
        usage = usage_of(output, completion_tokens)
        return ChatCompletionChunk(id=self.response_id, model=self.model, choices=[], usage=usage)

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for part in output.outputs:
            message, reason = self._message(part)
            choices.append(
                ChatChoice(
                    index=part.index,
                    message=message,
                    logprobs=chat_logprobs(part, self.num_top),
                    finish_reason=reason,
                    stop_reason=part.stop_reason,
                )
            )
        completion_tokens = sum(len(part.token_ids) for part in output.outputs)
        return ChatCompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=usage_of(output, completion_tokens),
        )

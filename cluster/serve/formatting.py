"""Engine outputs -> OpenAI bodies: whole responses, SSE chunks and usage.

One formatter per request turns the engine's `RequestOutput` deltas into the chunks of a stream
(`data: {json}` lines) or, from the cumulative output, one response body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from cluster.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from cluster.openai_api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
    Usage,
    UsageDetails,
    prompt_logprobs_body,
)
from cluster.openai_api.tool_output import ToolCallStream, finish_reason, tool_calls
from cluster.openai_api.tools import ToolCallPlan, tool_call_plan

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


def echo_logprobs(
    prompt_ids: list[int],
    positions: list[PositionLogprobs | None],
    num_top: int,
    first_token_text: str,
) -> CompletionLogprobs:
    """The echoed prompt in OpenAI's legacy logprobs: the first token's logprob is None (it has
    no context), offsets run over the decoded tokens from 0."""
    result = CompletionLogprobs()
    offset = 0
    for token_id, position in zip(prompt_ids, positions, strict=True):
        if position is None:
            text, logprob, top = first_token_text, None, None
        else:
            text, logprob = _chosen(position, token_id)
            top = dict(_top(position, token_id)[:num_top])
        result.tokens.append(text)
        result.token_logprobs.append(logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(text)
    return result


@dataclass(frozen=True)
class CompletionOptions:
    """What a `/v1/completions` request asks of its bodies beyond the generated text."""

    echo_text: str | None = None
    """The prompt's text, put before each choice's text (`echo`); None: no echo."""
    echo_logprobs: int | None = None
    """With echo and `logprobs`: the echoed tokens get logprobs with this many alternatives."""
    prompt_logprobs: bool = False
    """vLLM's `prompt_logprobs` list in each choice."""
    keep_completion: bool = True
    """False for `max_tokens=0`: only the echoed prompt is returned."""
    decode: Callable[[int], str] = lambda token_id: ""
    """The text of one token (the echoed prompt's first token has no logprob entry to read)."""


def completion_options(
    request: CompletionRequest, prompt_text: str | None, tokenizer: Any
) -> CompletionOptions:
    """What `request` asks of its bodies; `prompt_text`: the prompt as text (for the echo)."""

    def decode(token_id: int) -> str:
        return "" if tokenizer is None else str(tokenizer.decode([token_id]))

    return CompletionOptions(
        echo_text=(prompt_text or "") if request.echo else None,
        echo_logprobs=request.logprobs if request.echo else None,
        prompt_logprobs=request.prompt_logprobs is not None,
        keep_completion=request.max_tokens != 0,
        decode=decode,
    )


class CompletionFormatter:
    """`/v1/completions` bodies of one request.

    Prompt logprobs arrive with the prefill steps, possibly over several deltas; each choice's
    first body waits until the prompt's are complete when the echo or `prompt_logprobs` needs
    them, then carries the echoed prompt (text, and logprobs) ahead of the generated tokens."""

    def __init__(
        self, response_id: str, model: str, options: CompletionOptions | None = None
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.options = options or CompletionOptions()
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._prompt_positions: list[PositionLogprobs | None] = []
        self._held: dict[int, list[CompletionOutput]] = {}

    @property
    def _needs_prompt_logprobs(self) -> bool:
        return self.options.prompt_logprobs or (
            self.options.echo_text is not None and self.options.echo_logprobs is not None
        )

    def _prompt_ready(self, output: RequestOutput) -> bool:
        if output.prompt_logprobs:
            self._prompt_positions.extend(output.prompt_logprobs)
        if not self._needs_prompt_logprobs:
            return True
        return len(self._prompt_positions) >= len(output.prompt_token_ids)

    def _choice(self, part: CompletionOutput, output: RequestOutput) -> CompletionChoice:
        choice = CompletionChoice(
            index=part.index, text="", finish_reason=part.finish_reason,
            stop_reason=part.stop_reason,
        )  # fmt: skip
        if part.index not in self._started:
            self._started.add(part.index)
            self._start(choice, output)
        if self.options.keep_completion:
            offset = self._offsets.get(part.index, 0)
            logprobs = completion_logprobs(part, offset)
            if logprobs is not None:
                choice.logprobs = _joined(choice.logprobs, logprobs)
            choice.text += part.text
            self._offsets[part.index] = offset + len(part.text)
        return choice

    def _start(self, choice: CompletionChoice, output: RequestOutput) -> None:
        """The first body of a choice: the echoed prompt and the prompt's logprobs."""
        options = self.options
        if options.prompt_logprobs:
            choice.prompt_logprobs = prompt_logprobs_body(self._prompt_positions)
        if options.echo_text is None:
            return
        choice.text = options.echo_text
        if options.echo_logprobs is not None:
            first = options.decode(output.prompt_token_ids[0])
            choice.logprobs = echo_logprobs(
                output.prompt_token_ids, self._prompt_positions, options.echo_logprobs, first
            )
            self._offsets[choice.index] = sum(map(len, choice.logprobs.tokens))
        else:
            self._offsets[choice.index] = len(options.echo_text)

    def chunk(self, delta: RequestOutput) -> CompletionResponse | None:
        if not self._prompt_ready(delta):
            for part in delta.outputs:  # tokens before the prompt's logprobs are complete
                self._held.setdefault(part.index, []).append(part)
            return None
        parts = [_merged([*self._held.pop(part.index, []), part]) for part in delta.outputs]
        choices = [self._choice(part, delta) for part in parts]
        if not choices:
            return None
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices)

    def usage_chunk(self, output: RequestOutput, completion_tokens: int) -> CompletionResponse:
        usage = usage_of(output, self._kept(completion_tokens))
        return CompletionResponse(id=self.response_id, model=self.model, choices=[], usage=usage)

    def response(self, output: RequestOutput) -> CompletionResponse:
        self._prompt_ready(output)
        choices = [self._choice(part, output) for part in output.outputs]
        completion_tokens = sum(len(part.token_ids) for part in output.outputs)
        return CompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=usage_of(output, self._kept(completion_tokens)),
        )

    def _kept(self, completion_tokens: int) -> int:
        return completion_tokens if self.options.keep_completion else 0


def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(
        text_offset=first.text_offset + second.text_offset,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs,
    )


def _merged(parts: list[CompletionOutput]) -> CompletionOutput:
    """Consecutive deltas of one choice as one."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    logprobs = None
    if all(part.logprobs is not None for part in parts):
        logprobs = [position for part in parts for position in part.logprobs or []]
    return replace(
        last,
        text="".join(part.text for part in parts),
        token_ids=[token for part in parts for token in part.token_ids],
        logprobs=logprobs,
    )


class ChatFormatter:
    """`/v1/chat/completions` bodies of one request."""

    def __init__(
        self,
        response_id: str,
        model: str,
        num_top_logprobs: int,
        tools: ToolCallPlan | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.num_top = num_top_logprobs
        self.tools = tools
        """How tool calls are read from the reply (None: plain text)."""
        self.prompt_logprobs = prompt_logprobs
        """vLLM's `prompt_logprobs`: in the response, or in one chunk of a stream."""
        self._started: set[int] = set()
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._prompt_positions: list[PositionLogprobs | None] = []
        self._sent_prompt_logprobs = False

    def _take_prompt_logprobs(self, output: RequestOutput) -> PromptLogprobs | None:
        """The prompt's logprobs once complete (once per request), else None."""
        complete = len(self._prompt_positions) >= len(output.prompt_token_ids)
        if not self.prompt_logprobs or self._sent_prompt_logprobs or not complete:
            return None
        self._sent_prompt_logprobs = True
        return prompt_logprobs_body(self._prompt_positions)

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
        self._prompt_positions.extend(delta.prompt_logprobs or [])
        choices = [self._choice(part) for part in delta.outputs]
        if not choices:
            return None
        chunk = ChatCompletionChunk(id=self.response_id, model=self.model, choices=choices)
        chunk.prompt_logprobs = self._take_prompt_logprobs(delta)
        return chunk

    def usage_chunk(self, output: RequestOutput, completion_tokens: int) -> ChatCompletionChunk:
        usage = usage_of(output, completion_tokens)
        return ChatCompletionChunk(id=self.response_id, model=self.model, choices=[], usage=usage)

    def response(self, output: RequestOutput) -> ChatCompletionResponse:
        self._prompt_positions.extend(output.prompt_logprobs or [])
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
            prompt_logprobs=self._take_prompt_logprobs(output),
        )


def response_formatter(
    request: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    model: str,
    prompt_text: str | None,
    tokenizer: Any,
    tool_call_parser: str | None = None,
) -> CompletionFormatter | ChatFormatter:
    """The formatter of `request`'s bodies (the Serve replica's, and batch runs' OpenAI lines);
    `model`: the name the bodies carry."""
    if isinstance(request, ChatCompletionRequest):
        top = request.top_logprobs or 0
        plan = tool_call_plan(request, tool_call_parser) if request.tools else None
        scored = request.prompt_logprobs is not None
        return ChatFormatter(f"chatcmpl-{request_id}", model, top, plan, scored)
    options = completion_options(request, prompt_text, tokenizer)
    return CompletionFormatter(f"cmpl-{request_id}", model, options)

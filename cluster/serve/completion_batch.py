"""A `/v1/completions` request with a batch of prompts: one engine request per prompt.

Each prompt runs as its own request (`<id>-<i>`) through the replica's single-prompt path; their
bodies are merged into one answer as OpenAI does: choice `index` = prompt index x `n` + the
prompt's own choice index, usage summed, one response ID. A stream interleaves the prompts'
chunks as they come, with one usage chunk at the end when asked for. The first error (a prompt
too long, say) answers the whole request, and the other prompts are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from cluster.openai_api.protocol import CompletionRequest, CompletionResponse, ErrorResponse, Usage
from cluster.serve.formatting import DONE, sse

Generate = Callable[..., AsyncIterator[Any]]
_END = object()


async def batched_completion(
    generate: Generate, request: CompletionRequest, request_id: str, as_sse: bool
) -> AsyncIterator[ErrorResponse | str | BaseModel]:
    """The merged bodies of `request`'s prompts, each run through `generate` (the server's
    single-prompt path, called with `as_sse=False`)."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    tasks = [
        asyncio.create_task(_drain(generate, request, index, prompt, request_id, queue))
        for index, prompt in enumerate(request.prompts)
    ]
    merged = _Merge(f"cmpl-{request_id}", request.n)
    try:
        async for item in _merged_items(queue, len(tasks), merged):
            if isinstance(item, ErrorResponse):
                yield item
                return
            if request.stream:
                yield sse(item) if as_sse else item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not request.stream:
        yield merged.response()
        return
    if request.include_usage:
        usage = CompletionResponse(id=merged.id, model=merged.model, choices=[], usage=merged.usage)
        yield sse(usage) if as_sse else usage
    if as_sse:
        yield DONE


async def _drain(
    generate: Generate,
    request: CompletionRequest,
    index: int,
    prompt: str | list[int],
    request_id: str,
    queue: asyncio.Queue[tuple[int, Any]],
) -> None:
    single = request.model_copy(update={"prompt": prompt})
    try:
        async for item in generate(single, f"{request_id}-{index}", as_sse=False):
            await queue.put((index, item))
    finally:
        await queue.put((index, _END))


async def _merged_items(
    queue: asyncio.Queue[tuple[int, Any]], num_prompts: int, merged: _Merge
) -> AsyncIterator[ErrorResponse | CompletionResponse]:
    """Errors as they come, and each prompt's chunks re-indexed (usage chunks kept back)."""
    ended = 0
    while ended < num_prompts:
        index, item = await queue.get()
        if item is _END:
            ended += 1
        elif isinstance(item, ErrorResponse):
            yield item
        else:
            body = merged.add(index, item)
            if body.choices:
                yield body


class _Merge:
    """The prompts' bodies as one: choices re-indexed, usage summed."""

    def __init__(self, response_id: str, n: int) -> None:
        self.id = response_id
        self.n = n
        self.model = ""
        self.usage = Usage()
        self.choices: dict[int, Any] = {}

    def add(self, prompt_index: int, body: CompletionResponse) -> CompletionResponse:
        self.model = body.model
        choices = [
            choice.model_copy(update={"index": prompt_index * self.n + choice.index})
            for choice in body.choices
        ]
        for choice in choices:
            self.choices[choice.index] = choice
        if body.usage is not None:
            self._add_usage(body.usage)
        return body.model_copy(update={"id": self.id, "choices": choices, "usage": None})

    def _add_usage(self, usage: Usage) -> None:
        total = self.usage
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.total_tokens += usage.total_tokens
        if usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens
            if total.prompt_tokens_details is None:
                total.prompt_tokens_details = usage.prompt_tokens_details.model_copy()
            else:
                total.prompt_tokens_details.cached_tokens += cached

    def response(self) -> CompletionResponse:
        choices = [self.choices[index] for index in sorted(self.choices)]
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=self.usage)

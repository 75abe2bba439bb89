"""OpenAI request fields -> the engine's `SamplingParams`, in one place.

`openai_sampling_kwargs` lists every field in vLLM's spelling. Fields the engine's
`SamplingParams` does not have yet are passed on as soon as it does (they are matched by name);
until then a request that sets one gets a 400 naming it, never a silent no-op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cluster.openai_api.constraints import request_constraint
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from scheduler.request import SamplingParams

_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class UnsupportedFieldError(ValueError):
    """A request set a field the engine cannot honour yet."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name} is not supported by this server yet")
        self.param = name


def openai_sampling_kwargs(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> dict[str, Any]:
    """Every sampling field of `request` under its vLLM name (None: not set by the client)."""
    prompt_logprobs = request.prompt_logprobs
    if isinstance(request, ChatCompletionRequest):
        logprobs = request.top_logprobs or 0 if request.logprobs else None
    else:
        logprobs = request.logprobs
        if request.echo and logprobs is not None:  # the echoed prompt carries its logprobs
            prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    return {
        "n": request.n,
        "max_tokens": max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "min_tokens": request.min_tokens,
        "ignore_eos": request.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "stop_token_ids": tuple(request.stop_token_ids) if request.stop_token_ids else None,
        "stop": tuple(stop) if stop else None,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": {int(k): v for k, v in request.logit_bias.items()}
        if request.logit_bias
        else None,
    }


def to_sampling_params(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    """The engine's sampling parameters; ValueError (a 400) for invalid or unsupported ones."""
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise UnsupportedFieldError("suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise UnsupportedFieldError("best_of")
    kwargs: dict[str, Any] = {"structured_outputs": request_constraint(request)}
    for name, value in openai_sampling_kwargs(request, max_tokens).items():
        if value is None or (name == "ignore_eos" and value is False):
            continue
        if name not in _ENGINE_FIELDS:
            raise UnsupportedFieldError(name)
        kwargs[name] = value
    return SamplingParams(**kwargs)

"""What the offline `LLM` returns: one `CompletionResult` per prompt, vLLM's shape.

`RequestTracker` accumulates one request's step outputs (tokens, logprobs, finish) while the
engine runs and turns them into its `CompletionResult` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from scheduler.output import RequestOutput, TokenLogprobs
from scheduler.request import SamplingParams


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    """Decoded text (special tokens skipped); empty when the model has no tokenizer."""
    token_ids: list[int]
    finish_reason: str | None
    """"stop", "length" or "abort"."""
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class CompletionResult:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Logprobs of prompt tokens 1..n-1 (token 0 has none), when asked for."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class RequestTracker:
    """Accumulates one request's step outputs."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: RequestOutput | None = None

    def update(self, output: RequestOutput) -> None:
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs or [])
        self.prompt_logprobs.extend(output.prompt_logprobs or [])
        self.last = output

    def result(self, tokenizer: PreTrainedTokenizerBase | None) -> CompletionResult:
        last = self.last
        text = str(tokenizer.decode(self.token_ids, skip_special_tokens=True)) if tokenizer else ""
        output = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(self.token_ids),
            finish_reason=last.finish_reason.value if last and last.finish_reason else None,
            stop_token_id=last.stop_token_id if last else None,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
        )
        return CompletionResult(
            request_id=self.req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[output],
            prompt_logprobs=(
                list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None
            ),
            num_cached_tokens=last.num_cached_tokens if last else 0,
        )

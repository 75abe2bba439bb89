"""What the engine returns, in vLLM's shape: `RequestOutput` holding one `CompletionOutput` per
sample (`n`), with logprobs as `{token_id: Logprob}` dicts and request timings.

A stream carries *deltas*: each item holds only what is new since the previous item (new text and
token IDs per completion index, new logprobs, the inter-token latencies of the new tokens).
`OutputAccumulator` adds deltas up into the cumulative result `LLM.generate` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Logprob:
    """Log probability of one token at one position."""

    logprob: float
    rank: int | None = None
    """1 for the most likely token."""
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""Token ID -> its logprob at one position: the chosen token plus the top alternatives."""


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence of a request (or the part of it new in a stream item)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    """Sum of the sampled tokens' logprobs, when logprobs were asked for."""
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    """"stop", "length" or "abort"; None while running."""
    stop_reason: int | str | None = None
    """The stop token ID or stop string that ended the sequence (None for EOS or length)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """Timings of one request, wall-clock seconds since the epoch."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    """Seconds between consecutive tokens of the first sequence (in a delta: the new ones)."""

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request: cumulative (from `LLM.generate`) or a stream delta."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """One entry per prompt token, the first None (it has no context), when asked for."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: RequestMetrics | None = None

    @property
    def finish_reason(self) -> str | None:
        """Finish reason of the first sequence (a shortcut for n = 1)."""
        return self.outputs[0].finish_reason if self.outputs else None


class OutputAccumulator:
    """Adds the delta items of one request's stream into its cumulative `RequestOutput`."""

    def __init__(self) -> None:
        self._result: RequestOutput | None = None
        self._completions: dict[int, CompletionOutput] = {}
        self._latencies: list[float] = []

    def add(self, delta: RequestOutput) -> RequestOutput:
        """Fold in one delta; returns the cumulative output so far."""
        for part in delta.outputs:
            self._completions[part.index] = _extend(self._completions.get(part.index), part)
        if delta.metrics is not None:
            self._latencies.extend(delta.metrics.inter_token_latencies)
        previous = self._result
        prompt_logprobs = delta.prompt_logprobs
        if previous is not None and previous.prompt_logprobs is not None:
            prompt_logprobs = previous.prompt_logprobs + (prompt_logprobs or [])
        metrics = delta.metrics
        if metrics is not None:
            metrics = replace(metrics, inter_token_latencies=list(self._latencies))
        self._result = replace(
            delta,
            outputs=[self._completions[index] for index in sorted(self._completions)],
            prompt_logprobs=prompt_logprobs,
            metrics=metrics,
        )
        return self._result

    @property
    def result(self) -> RequestOutput | None:
        return self._result


def _extend(total: CompletionOutput | None, part: CompletionOutput) -> CompletionOutput:
    if total is None:
        return replace(part, token_ids=list(part.token_ids))
    logprobs = total.logprobs
    if part.logprobs is not None:
        logprobs = (logprobs or []) + part.logprobs
    return replace(
        part,
        text=total.text + part.text,
        token_ids=total.token_ids + part.token_ids,
        logprobs=logprobs,
    )

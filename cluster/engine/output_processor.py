"""Turns the scheduler's `RequestStepOutput`s into vLLM-shaped `RequestOutput` deltas.

One `_RequestState` per engine request: the `n` sequences it fans out into (each a scheduler
request of its own, sharing the prompt's KV blocks through the prefix cache), their incremental
detokenizers (text and stop strings) and the request's timings.

    EngineRequest ──add──► n scheduler Requests ──step outputs──► process() ──► RequestOutput deltas
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from cluster.engine.request import EngineRequest
from scheduler.output import RequestStepOutput, TokenLogprobs


def child_request_id(request_id: str, index: int, n: int) -> str:
    """Scheduler request ID of sample `index` of a request with `n` samples."""
    return request_id if n == 1 else f"{index}|{request_id}"


class _NoText:
    """The detokenizer of a model without a tokenizer: token IDs only, no text."""

    stop_reason = None
    finished_by_stop_string = False

    def update(self, new_token_ids: list[int], final: bool = False) -> str:
        return ""


@dataclass
class _Sequence:
    """One of the request's `n` samples."""

    index: int
    detokenizer: IncrementalDetokenizer | _NoText
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0


@dataclass
class _RequestState:
    request: EngineRequest
    sequences: dict[str, _Sequence]
    """Scheduler request ID -> sample."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    pending_prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=lambda: [None])
    """Prompt logprobs not yet sent; the first prompt token has none (vLLM's leading None)."""

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences.values())


class OutputProcessor:
    """Per-request output state of one engine."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._parent_of: dict[str, str] = {}
        """Scheduler request ID -> engine request ID."""

    def add(self, request: EngineRequest, child_ids: list[str]) -> None:
        prompt_ids = list(request.prompt_token_ids)
        sequences = {
            child_id: _Sequence(index, self._detokenizer(prompt_ids, request))
            for index, child_id in enumerate(child_ids)
        }
        self._states[request.request_id] = _RequestState(request, sequences)
        for child_id in child_ids:
            self._parent_of[child_id] = request.request_id

    def _detokenizer(
        self, prompt_ids: list[int], request: EngineRequest
    ) -> IncrementalDetokenizer | _NoText:
        if self.tokenizer is None:
            return _NoText()
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, request.sampling_params)

    def child_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        return list(state.sequences) if state is not None else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def request_ids(self) -> list[str]:
        """The engine request IDs not finished yet."""
        return list(self._states)

    def mark_scheduled(self, child_ids: Iterable[str], now: float) -> None:
        """Record the first time each request got tokens scheduled (ends its queue time)."""
        for child_id in child_ids:
            state = self._states.get(self._parent_of.get(child_id, ""))
            if state is not None and state.first_scheduled_time is None:
                state.first_scheduled_time = now

    def process(
        self, step_outputs: list[RequestStepOutput], now: float
    ) -> tuple[list[RequestOutput], list[str]]:
        """This step's deltas, and the scheduler requests a stop string ended (to abort)."""
        parts: dict[str, list[CompletionOutput]] = {}
        latencies: dict[str, list[float]] = {}
        stopped: list[str] = []
        for step_output in step_outputs:
            parent_id = self._parent_of.get(step_output.req_id)
            if parent_id is None:
                continue  # finished earlier (stop string), its abort echo arrives now
            state = self._states[parent_id]
            sequence = state.sequences[step_output.req_id]
            part = self._advance(state, sequence, step_output, now, latencies)
            parts.setdefault(parent_id, []).append(part)
            if sequence.finish_reason is not None:
                del self._parent_of[step_output.req_id]
                if (
                    sequence.detokenizer.finished_by_stop_string
                    and step_output.finish_reason is None
                ):
                    stopped.append(step_output.req_id)
        deltas = [
            self._delta(parent_id, completions, latencies.get(parent_id, []), now)
            for parent_id, completions in parts.items()
        ]
        return deltas, stopped

    def _advance(
        self,
        state: _RequestState,
        sequence: _Sequence,
        step_output: RequestStepOutput,
        now: float,
        latencies: dict[str, list[float]],
    ) -> CompletionOutput:
        new_ids = list(step_output.new_token_ids)
        if new_ids:
            if state.first_token_time is None:
                state.first_token_time = now
            elif sequence.index == 0 and state.last_token_time is not None:
                latencies.setdefault(state.request.request_id, []).append(
                    now - state.last_token_time
                )
            if sequence.index == 0:
                state.last_token_time = now
        if step_output.num_cached_tokens:
            state.num_cached_tokens = max(state.num_cached_tokens, step_output.num_cached_tokens)
        if step_output.prompt_logprobs and sequence.index == 0:  # n > 1: each child scores
            state.pending_prompt_logprobs.extend(self._convert(step_output.prompt_logprobs))
        text = sequence.detokenizer.update(new_ids, final=step_output.finish_reason is not None)
        logprobs = None
        if step_output.new_logprobs is not None:
            logprobs = self._convert(step_output.new_logprobs)
            sequence.cumulative_logprob += sum(lp.logprob for lp in step_output.new_logprobs)
        self._finish(sequence, step_output)
        params = state.request.sampling_params
        return CompletionOutput(
            index=sequence.index,
            text=text,
            token_ids=new_ids,
            cumulative_logprob=sequence.cumulative_logprob if params.logprobs is not None else None,
            logprobs=logprobs if params.logprobs is not None else None,
            finish_reason=sequence.finish_reason,
            stop_reason=sequence.stop_reason,
        )

    def _finish(self, sequence: _Sequence, step_output: RequestStepOutput) -> None:
        detokenizer = sequence.detokenizer
        if detokenizer.finished_by_stop_string:
            sequence.finish_reason, sequence.stop_reason = "stop", detokenizer.stop_reason
        elif step_output.finish_reason is not None:
            sequence.finish_reason = step_output.finish_reason.value
            sequence.stop_reason = step_output.stop_token_id

    def _delta(
        self,
        parent_id: str,
        completions: list[CompletionOutput],
        latencies: list[float],
        now: float,
    ) -> RequestOutput:
        state = self._states[parent_id]
        request = state.request
        finished = state.finished
        if finished:
            del self._states[parent_id]
        prompt_logprobs = None
        if request.sampling_params.prompt_logprobs is not None:
            prompt_logprobs, state.pending_prompt_logprobs = state.pending_prompt_logprobs, []
        return RequestOutput(
            request_id=parent_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=state.first_scheduled_time,
                first_token_time=state.first_token_time,
                last_token_time=state.last_token_time,
                finished_time=now if finished else None,
                inter_token_latencies=latencies,
            ),
        )

    def _convert(self, entries: list[TokenLogprobs]) -> list[PositionLogprobs]:
        return [self._position_logprobs(entry) for entry in entries]

    def _position_logprobs(self, entry: TokenLogprobs) -> PositionLogprobs:
        position = {
            token_id: Logprob(logprob, rank, self._decode(token_id))
            for rank, (token_id, logprob) in enumerate(
                zip(entry.top_token_ids, entry.top_logprobs, strict=True), start=1
            )
        }
        if entry.token_id not in position:
            position[entry.token_id] = Logprob(
                entry.logprob, entry.rank, self._decode(entry.token_id)
            )
        return {entry.token_id: position.pop(entry.token_id), **position}

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode([token_id]))


def now() -> float:
    """The engine's clock (wall time, comparable with `EngineRequest.arrival_time`)."""
    return time.time()

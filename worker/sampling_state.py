"""Per-request sampling state that outlives a step, and the step's `SamplingTensors`.

The model runner calls `update` once the request states took a step's deltas, and `build` with
the requests that sample. Requests that use no penalty, bias, allowed tokens, bad words or
min_tokens cost a few attribute reads; their rows skip every logits edit.

    output counts   [capacity, vocab] int32   one row per running request with penalties; each
    prompt mask     [capacity, vocab] bool    step adds only the tokens appended since the last
                                              (capacity doubles on demand, rows are reused)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.output import SchedulerOutput
from scheduler.request import SamplingParams
from worker.input_batch import CachedRequestState
from worker.logits_processors import (
    AllowedTokens,
    BadWordPatterns,
    LogitsAdjustments,
    Penalties,
    TokenBias,
    bad_word_bans,
)
from worker.sampler import SamplingTensors

MIN_CAPACITY = 4


@dataclass
class _CountedRow:
    row: int
    num_counted: int
    """Tokens of the request's `token_ids` already in its counts row (prompt included)."""


class TokenCounts:
    """Output token counts and prompt masks, on the device, of requests with penalties."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.output_counts = torch.zeros((0, 0), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, 0), dtype=torch.bool, device=device)
        self._entries: dict[str, _CountedRow] = {}
        self._free_rows: list[int] = []

    def drop(self, req_id: str) -> None:
        entry = self._entries.pop(req_id, None)
        if entry is not None:
            self._free_rows.append(entry.row)

    def rows_for(self, reqs: Sequence[CachedRequestState], vocab_size: int) -> torch.Tensor:
        """Count rows of `reqs` (added when new), brought up to date with their tokens."""
        rows: list[int] = []
        new_rows: list[int] = []
        new_ids: list[int] = []
        for req in reqs:
            entry = self._entries.get(req.req_id) or self._add(req, vocab_size)
            start = max(entry.num_counted, len(req.prompt_token_ids))
            new = req.token_ids[start:]  # normally the one token sampled last step
            new_rows.extend([entry.row] * len(new))
            new_ids.extend(new)
            entry.num_counted = req.num_tokens
            rows.append(entry.row)
        if new_ids:
            index = torch.tensor([new_rows, new_ids], dtype=torch.int64).to(self.device)
            ones = torch.ones(len(new_ids), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def _add(self, req: CachedRequestState, vocab_size: int) -> _CountedRow:
        if self.output_counts.shape[1] not in (0, vocab_size):
            raise RuntimeError(f"vocabulary changed from {self.output_counts.shape[1]}")
        if not self._free_rows:
            self._grow(vocab_size)
        row = self._free_rows.pop()
        self.output_counts[row] = 0
        self.prompt_mask[row] = False
        prompt = torch.tensor(req.prompt_token_ids, dtype=torch.int64).to(self.device)
        self.prompt_mask[row, prompt] = True
        entry = _CountedRow(row, num_counted=len(req.prompt_token_ids))
        self._entries[req.req_id] = entry
        return entry

    def _grow(self, vocab_size: int) -> None:
        old = self.output_counts.shape[0]
        capacity = max(MIN_CAPACITY, 2 * old)
        counts = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=self.device)
        mask = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=self.device)
        if old:
            counts[:old] = self.output_counts
            mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self._free_rows.extend(range(capacity - 1, old - 1, -1))


@dataclass(frozen=True)
class _RequestLists:
    """A request's allowed ids and logit bias on the device, and its bad-word patterns."""

    allowed: torch.Tensor | None  # [num_allowed] int64
    bias_ids: torch.Tensor | None  # [num_biased] int64
    bias_values: torch.Tensor | None  # [num_biased] fp32
    bad_words: BadWordPatterns | None


def _uses_bad_words(params: SamplingParams) -> bool:
    return bool(params.bad_words or params.bad_words_token_ids)


def _uses_lists(params: SamplingParams) -> bool:
    return (
        params.allowed_token_ids is not None or bool(params.logit_bias) or _uses_bad_words(params)
    )


class SamplingState:
    """Builds each step's `SamplingTensors`; keeps what must not be rebuilt every step."""

    def __init__(self, device: torch.device, eos_token_ids: Sequence[int] = ()) -> None:
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        """Banned before `min_tokens` unless the request ignores EOS."""
        self.counts = TokenCounts(device)
        self._lists: dict[str, _RequestLists] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Forget finished and preempted requests, and resumed ones (their tokens were reset)."""
        resumed = [c.req_id for c in scheduler_output.scheduled_cached_reqs if c.is_resumed]
        for req_id in (
            *scheduler_output.finished_req_ids,
            *scheduler_output.preempted_req_ids,
            *resumed,
        ):
            self.counts.drop(req_id)
            self._lists.pop(req_id, None)

    def build(self, reqs: Sequence[CachedRequestState], vocab_size: int) -> SamplingTensors:
        """The tensors of one step's sampling rows (`reqs`, in row order)."""
        params = [req.sampling_params for req in reqs]
        return SamplingTensors.build(
            params,
            [req.generator for req in reqs],
            vocab_size,
            self.device,
            self._banned(reqs, vocab_size),
            self._adjustments(reqs, vocab_size),
        )

    def _request_lists(self, req: CachedRequestState, vocab_size: int) -> _RequestLists:
        lists = self._lists.get(req.req_id)
        if lists is None:
            lists = self._lists[req.req_id] = _make_lists(req, vocab_size, self.device)
        return lists

    def _banned(self, reqs: Sequence[CachedRequestState], vocab_size: int) -> list[list[int]]:
        """Per row: stop tokens before min_tokens, and bad words' last tokens where they match."""
        banned: list[list[int]] = [[] for _ in reqs]
        bad_rows: list[int] = []
        patterns: list[BadWordPatterns] = []
        for row, req in enumerate(reqs):
            params = req.sampling_params
            if req.num_tokens - len(req.prompt_token_ids) < params.min_tokens:
                eos = () if params.ignore_eos else self.eos_token_ids
                banned[row].extend(dict.fromkeys(params.stop_token_ids + eos))
            if _uses_bad_words(params):
                words = self._request_lists(req, vocab_size).bad_words
                if words is not None:
                    bad_rows.append(row)
                    patterns.append(words)
        if bad_rows:
            tails = [_output_tail(reqs[row], p) for row, p in zip(bad_rows, patterns, strict=True)]
            owners, tokens = bad_word_bans(patterns, tails)
            for owner, token in zip(owners.tolist(), tokens.tolist(), strict=True):
                banned[bad_rows[owner]].append(token)
        return banned if any(banned) else []

    def _adjustments(
        self, reqs: Sequence[CachedRequestState], vocab_size: int
    ) -> LogitsAdjustments | None:
        penalised = [row for row, req in enumerate(reqs) if req.sampling_params.uses_penalties]
        listed = [row for row, req in enumerate(reqs) if _uses_lists(req.sampling_params)]
        if not penalised and not listed:
            return None
        lists = {row: self._request_lists(reqs[row], vocab_size) for row in listed}
        return LogitsAdjustments(
            allowed=self._allowed(lists),
            bias=self._bias(lists),
            penalties=self._penalties(reqs, penalised, vocab_size),
        )

    def _allowed(self, lists: dict[int, _RequestLists]) -> AllowedTokens | None:
        rows = [row for row, entry in lists.items() if entry.allowed is not None]
        if not rows:
            return None
        ids = [lists[row].allowed for row in rows]
        sizes = torch.tensor([len(t) for t in ids if t is not None], device=self.device)
        return AllowedTokens(
            rows=torch.tensor(rows, dtype=torch.int64).to(self.device),
            pair_idx=torch.repeat_interleave(torch.arange(len(rows), device=self.device), sizes),
            token_ids=torch.cat([t for t in ids if t is not None]),
        )

    def _bias(self, lists: dict[int, _RequestLists]) -> TokenBias | None:
        rows = [row for row, entry in lists.items() if entry.bias_ids is not None]
        if not rows:
            return None
        ids = [t for row in rows if (t := lists[row].bias_ids) is not None]
        values = [t for row in rows if (t := lists[row].bias_values) is not None]
        sizes = torch.tensor([len(t) for t in ids], device=self.device)
        return TokenBias(
            rows=torch.repeat_interleave(torch.tensor(rows, device=self.device), sizes),
            token_ids=torch.cat(ids),
            values=torch.cat(values),
        )

    def _penalties(
        self, reqs: Sequence[CachedRequestState], rows: list[int], vocab_size: int
    ) -> Penalties | None:
        if not rows:
            return None
        count_rows = self.counts.rows_for([reqs[row] for row in rows], vocab_size)
        params = [reqs[row].sampling_params for row in rows]
        values = torch.tensor(
            [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
            dtype=torch.float32,
        ).to(self.device)
        return Penalties(
            rows=torch.tensor(rows, dtype=torch.int64).to(self.device),
            prompt_mask=self.counts.prompt_mask[count_rows],
            output_counts=self.counts.output_counts[count_rows],
            repetition=values[:, 0],
            frequency=values[:, 1],
            presence=values[:, 2],
        )


def _output_tail(req: CachedRequestState, patterns: BadWordPatterns) -> list[int]:
    """The last output tokens a bad-word prefix can span."""
    width = patterns.prefixes.shape[1]
    return req.token_ids[max(len(req.prompt_token_ids), req.num_tokens - width) :]


def _make_lists(req: CachedRequestState, vocab_size: int, device: torch.device) -> _RequestLists:
    params = req.sampling_params
    if params.bad_words and params.bad_words_token_ids is None:
        raise RuntimeError(
            f"request {req.req_id}: bad_words were not tokenized; the engine must attach "
            "SamplingParams.with_bad_words_token_ids before sending the request"
        )
    params.verify_token_ids(vocab_size)
    allowed = bias_ids = bias_values = None
    if params.allowed_token_ids is not None:
        allowed = torch.tensor(params.allowed_token_ids, dtype=torch.int64).to(device)
    if params.logit_bias:
        ids, values = zip(*params.logit_bias, strict=True)
        bias_ids = torch.tensor(ids, dtype=torch.int64).to(device)
        bias_values = torch.tensor(values, dtype=torch.float32).to(device)
    bad_words = None
    if params.bad_words_token_ids:
        bad_words = BadWordPatterns.build(params.bad_words_token_ids)
    return _RequestLists(allowed, bias_ids, bias_values, bad_words)

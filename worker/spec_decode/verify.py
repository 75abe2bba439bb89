"""The verify step's sampling: the requests with drafts go through the rejection sampler, the
others through the usual sampler; logprobs of every emitted token come from the raw logits.

    logits rows of the step:  [ req 0: 1 + m0 rows | req 1: 1 + m1 rows | ... ]
                              a request without drafts has one row (m = 0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.output import TokenLogprobs
from worker.grammar_mask import apply_grammar_mask
from worker.sampler import SamplingTensors, to_token_logprobs
from worker.spec_decode.rejection_sampler import VerifyRows, rejection_sample, target_probs


@dataclass(frozen=True)
class RowLayout:
    """Where each sampling request's rows are in the step's logits."""

    starts: list[int]
    num_drafts: list[int]

    @classmethod
    def from_drafts(cls, drafts: Sequence[Sequence[int]]) -> RowLayout:
        starts, start = [], 0
        for request in drafts:
            starts.append(start)
            start += 1 + len(request)
        return cls(starts, [len(request) for request in drafts])

    def last_rows(self, indices: Sequence[int]) -> list[int]:
        """The last row (the one a plain step samples from) of each request in `indices`."""
        return [self.starts[i] + self.num_drafts[i] for i in indices]

    def all_rows(self, indices: Sequence[int]) -> list[int]:
        return [
            row
            for i in indices
            for row in range(self.starts[i], self.starts[i] + 1 + self.num_drafts[i])
        ]


@dataclass(frozen=True)
class Verified:
    token_ids: list[list[int]]
    """Per request with drafts: the accepted drafts, then the token after them."""
    logprobs: list[list[TokenLogprobs] | None]


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    tensors: SamplingTensors,
    generator: torch.Generator,
) -> Verified:
    """Accept or reject the drafts of requests whose rows are `logits` [sum(1 + m), vocab];
    `tensors` holds one row per logits row (structured outputs: each row masked by the grammar
    state after the drafts before it; logprobs stay those of the raw logits, as without
    drafts)."""
    rows = VerifyRows.build(drafts, logits.device)
    constrained = logits if tensors.grammar is None else apply_grammar_mask(logits, tensors.grammar)
    probs = target_probs(constrained, tensors)
    token_ids = rejection_sample(probs, rows, tensors, generator)
    return Verified(token_ids, _logprobs(logits, RowLayout.from_drafts(drafts), token_ids, tensors))


def _logprobs(
    logits: torch.Tensor,
    layout: RowLayout,
    token_ids: list[list[int]],
    tensors: SamplingTensors,
) -> list[list[TokenLogprobs] | None]:
    out: list[list[TokenLogprobs] | None] = []
    for start, tokens in zip(layout.starts, token_ids, strict=True):
        num_top = tensors.num_logprobs[start]
        if num_top is None:
            out.append(None)
            continue
        index = torch.arange(start, start + len(tokens), device=logits.device)
        ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        out.append(to_token_logprobs(logits[index], ids, [num_top] * len(tokens)))
    return out

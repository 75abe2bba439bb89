"""Draft proposers: given each decoding request's tokens, the drafts the next step verifies.

The model runner calls `propose` on the driver rank after sampling, with every request that
sampled and may speculate; a proposer that runs a model (draft model, MTP, EAGLE heads) gets
the same call and keeps its own state.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.spec_config import SpecMethod, SpeculativeConfig
from worker.spec_decode.ngram import propose_ngram


@dataclass(frozen=True)
class DraftRequest:
    """One request to draft for: its tokens so far (prompt, outputs, this step's tokens)."""

    req_id: str
    token_ids: Sequence[int]


class DraftProposer(abc.ABC):
    """Proposes up to `num_speculative_tokens` drafts per request."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """Drafts per request ID (a request may get none)."""

    def forget(self, req_ids: Sequence[str]) -> None:  # noqa: B027 (optional hook)
        """Drop the state of finished or preempted requests (proposers with state)."""


class NgramProposer(DraftProposer):
    """Prompt lookup: no weights, no state."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        super().__init__(num_speculative_tokens)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for request in requests:
            found = propose_ngram(
                request.token_ids, self.min_n, self.max_n, self.num_speculative_tokens
            )
            if found:
                drafts[request.req_id] = found
        return drafts


def make_proposer(config: SpeculativeConfig) -> DraftProposer:
    """The proposer of `config.method`; ValueError for a method this build cannot run."""
    if config.method is SpecMethod.NGRAM:
        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    raise ValueError(
        f"speculative_config method {config.method.value!r} is not supported yet; use 'ngram'"
    )

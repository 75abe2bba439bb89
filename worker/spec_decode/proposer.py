"""Draft proposers: given each decoding request's tokens, the drafts the next step verifies.

The model runner calls `propose` on the driver rank after sampling, with every request that
sampled and may speculate. A proposer that runs a model (draft model, MTP, EAGLE heads) also
lists its attention and recurrent-state layers (`drafter_layers`, `drafter_state_layers`: the
runner plans KV cache groups of their own for them in the shared pool), gets those groups bound
(`bind`), sees every step's batch after the target's forward (`observe`, with the target's
hidden states: what MTP and EAGLE heads read), and runs its own steps on the bound cache in
`propose`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.attention.attention import Attention, ForwardContext
from worker.attention.attention_groups import AttentionGroup
from worker.input_batch import InputBatch, RequestStates
from worker.kv_cache import KVCaches
from worker.spec_decode.draft_states import DrafterStateGroups, StepSaves
from worker.spec_decode.ngram import propose_ngram
from worker.state.state_layer import StateLayer


@dataclass(frozen=True)
class DrafterCache:
    """What a proposer with a model needs from the runner to run steps of its own."""

    attention_groups: list[AttentionGroup]
    """The drafter's attention groups (its own KV cache groups only)."""
    kv_caches: KVCaches
    states: RequestStates
    """The runner's requests and block tables (every group's)."""
    state_groups: DrafterStateGroups | None = None
    """The drafter's recurrent-state groups (None: its model has no state layers)."""


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

    @property
    def drafter_layers(self) -> list[Attention]:
        """Attention layers of the proposer's own model (none without a model)."""
        return []

    @property
    def runs_on_every_rank(self) -> bool:
        """Whether every tensor-parallel rank runs `propose` (a sharded drafter model), not
        only the driver."""
        return False

    @property
    def drafter_state_layers(self) -> list[StateLayer]:
        """Recurrent-state layers of the proposer's own model (none without a model)."""
        return []

    def bind(self, cache: DrafterCache) -> None:  # noqa: B027 (optional hook)
        """Receive the drafter's KV cache groups (after the runner allocated them)."""

    def observe(  # noqa: B027 (optional hook)
        self,
        batch: InputBatch,
        ctx: ForwardContext,
        hidden: torch.Tensor,
        saves: StepSaves | None = None,
    ) -> None:
        """See a step's batch after the target's forward; `hidden` [num_tokens, hidden] holds
        the target's last hidden states (`ctx` covers the drafter's layers too); `saves`: the
        states the step keeps (draft positions of recurrent groups)."""


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

"""MTP proposer: the checkpoint's multi-token-prediction layer drafts k tokens greedily.

The MTP layer's attention has a KV cache group of its own in the shared pool (a drafter spec,
as a draft model's). Its KV at position i is computed from (token i + 1, the target's hidden
state at i):

    every step        after the target's forward, the MTP layer runs on the step's rows with
                      the tokens one to the right; a row whose next token is not known yet
                      (the last one of a sampling request) gets a placeholder
    after sampling    step 1 at P - 1 (the last computed position) with the emitted token and
                      the target's hidden state there (this rewrites the placeholder), steps
                      2 .. k at P .. P + k - 2 with the previous draft and the MTP's own output

Drafts are greedy (see `draft_model`). A cached MTP block's last position was computed with
the token after the block, which a later request may not share: only its drafts can differ,
never its outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.attention.attention import ForwardContext
from worker.input_batch import InputBatch
from worker.models.qwen3_next_mtp import Qwen3NextMTP
from worker.spec_decode.draft_model import ModelProposer, greedy_drafts, require_cache
from worker.spec_decode.draft_states import StepSaves
from worker.spec_decode.proposer import DraftRequest


@dataclass(frozen=True)
class _ObservedStep:
    hidden: torch.Tensor
    """The target's hidden states of the step's rows."""
    first_rows: dict[str, tuple[int, int]]
    """Per request: its first row and that row's position."""


class MtpProposer(ModelProposer):
    """Greedy drafts of the checkpoint's MTP layer."""

    model: Qwen3NextMTP

    def __init__(self, num_speculative_tokens: int, model: Qwen3NextMTP) -> None:
        super().__init__(num_speculative_tokens, model)
        self._step: _ObservedStep | None = None

    def observe(
        self,
        batch: InputBatch,
        ctx: ForwardContext,
        hidden: torch.Tensor,
        saves: StepSaves | None = None,
    ) -> None:
        starts = batch.query_start_loc_np
        self.model(self._next_tokens(batch), batch.positions, hidden, ctx)
        self._step = _ObservedStep(
            hidden,
            {
                req_id: (int(starts[i]), int(batch.num_computed_np[i]))
                for i, req_id in enumerate(batch.req_ids)
            },
        )

    def _next_tokens(self, batch: InputBatch) -> torch.Tensor:
        """Per row, the token after it: the next row's, or after a request's last row the
        known token there (0 when it is still to be sampled)."""
        requests = require_cache(self._cache).states.requests
        shifted = torch.zeros_like(batch.input_ids)
        shifted[:-1] = batch.input_ids[1:]
        after_last = []
        for req_id, seq_len in zip(batch.req_ids, batch.seq_lens_np.tolist(), strict=True):
            tokens = requests[req_id].token_ids
            after_last.append(tokens[seq_len] if seq_len < len(tokens) else 0)
        ends = torch.as_tensor(batch.query_start_loc_np[1:] - 1, device=shifted.device)
        shifted[ends] = torch.tensor(after_last, dtype=shifted.dtype, device=shifted.device)
        return shifted

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        cache = require_cache(self._cache)
        step = self._step
        if step is None or not requests:
            return {}
        req_ids = [request.req_id for request in requests]
        tokens = [int(request.token_ids[-1]) for request in requests]
        positions = [len(request.token_ids) - 2 for request in requests]
        rows = [
            step.first_rows[req_id][0] + pos - step.first_rows[req_id][1]
            for req_id, pos in zip(req_ids, positions, strict=True)
        ]
        previous = step.hidden[torch.tensor(rows, device=step.hidden.device)]
        model = self.model

        def mtp_step(batch: InputBatch, ctx: ForwardContext, live: list[int]) -> torch.Tensor:
            index = torch.tensor(live, device=previous.device)
            out = model(batch.input_ids, batch.positions, previous[index], ctx)
            previous[index] = out  # the next step's hidden input
            return model.compute_logits(out)

        return greedy_drafts(
            cache,
            req_ids,
            list(zip(positions, tokens, strict=True)),
            self.num_speculative_tokens,
            mtp_step,
        )

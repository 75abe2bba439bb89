"""Drafting on every tensor-parallel rank: a drafter model is sharded like the target, so each
rank runs its draft steps in lockstep, on the tokens the driver rank sampled (which every rank
receives once per step: `worker.distributed.broadcast_token_lists`)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.spec_config import supports_speculation
from worker.input_batch import CachedRequestState
from worker.spec_decode.proposer import DraftProposer, DraftRequest


def run_proposer(
    proposer: DraftProposer,
    sampled: Sequence[CachedRequestState],
    tokens: Sequence[Sequence[int]],
    appended: bool,
) -> dict[str, list[int]]:
    """Drafts of the requests that sampled and may speculate, from the `tokens` each emitted
    this step (the driver's, on every rank). `appended`: the requests' token ids already hold
    them."""
    requests = [
        DraftRequest(req.req_id, req.token_ids if appended else [*req.token_ids, *emitted])
        for req, emitted in zip(sampled, tokens, strict=True)
        if supports_speculation(req.sampling_params)
    ]
    return proposer.propose(requests)

"""Drafting on every tensor-parallel rank: a drafter model is sharded like the target, so each
rank runs its draft steps in lockstep, on the tokens the driver rank sampled (sent to the
others once per step)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scheduler.spec_config import supports_speculation
from worker.distributed import broadcast, tp_size
from worker.input_batch import CachedRequestState
from worker.spec_decode.proposer import DraftProposer, DraftRequest


def share_emitted(
    tokens: Sequence[Sequence[int]] | None, widths: Sequence[int], device: torch.device
) -> list[list[int]]:
    """The tokens each sampling request emitted this step, on every rank: the driver passes
    its `tokens`, the other ranks None; `widths[i]`: the most request i may emit (1 + its
    drafts), known to every rank."""
    table = torch.zeros(len(widths), max(widths, default=1), dtype=torch.int64)
    for row, emitted in enumerate(tokens or ()):
        table[row, : len(emitted)] = torch.tensor(emitted, dtype=torch.int64) + 1
    shared = broadcast(table.to(device)).tolist()
    return [[token - 1 for token in row if token > 0] for row in shared]


def run_proposer(
    proposer: DraftProposer,
    sampled: Sequence[CachedRequestState],
    tokens: Sequence[Sequence[int]] | None,
    widths: Sequence[int],
    appended: bool,
    device: torch.device,
) -> dict[str, list[int]]:
    """Drafts of the requests that sampled and may speculate. With a drafter model and several
    ranks, every rank calls this: the driver with the tokens it sampled, the others with None
    (they get the driver's). `appended`: the requests' token ids already hold them."""
    if proposer.runs_on_every_rank and tp_size() > 1:
        tokens = share_emitted(tokens, widths, device)
    if tokens is None:
        raise RuntimeError("only the driver rank samples: a rank without tokens cannot draft")
    requests = [
        DraftRequest(req.req_id, req.token_ids if appended else [*req.token_ids, *emitted])
        for req, emitted in zip(sampled, tokens, strict=True)
        if supports_speculation(req.sampling_params)
    ]
    return proposer.propose(requests)

"""Draft proposers for tests of speculative decoding, each with a known acceptance.

They read the target's own greedy continuations (from a run without speculation): `oracle`
drafts exactly them (every draft accepted), `perturbed` changes every second draft (about half
accepted), `random` draws tokens (almost none accepted). `install_proposer` puts one into an
offline `LLM` in place of its configured proposer. `save_perturbed_copy` writes a draft model
close to a target (part of its drafts accepted).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from copy import deepcopy
from pathlib import Path

import torch

from cluster import LLM
from worker.spec_decode.proposer import DraftProposer, DraftRequest

VOCAB = 256


class ScriptedProposer(DraftProposer):
    """Drafts from known full sequences (prompt + greedy output), altered by `kind`."""

    def __init__(self, num_drafts: int, sequences: Sequence[Sequence[int]], kind: str) -> None:
        super().__init__(num_drafts)
        self.sequences = [list(sequence) for sequence in sequences]
        self.kind = kind
        self.rng = random.Random(0)

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        return {request.req_id: self._drafts(list(request.token_ids)) for request in requests}

    def _drafts(self, tokens: list[int]) -> list[int]:
        num = self.num_speculative_tokens
        if self.kind == "random":
            return [self.rng.randrange(VOCAB) for _ in range(num)]
        for sequence in self.sequences:
            if sequence[: len(tokens)] == tokens:
                drafts = sequence[len(tokens) : len(tokens) + num]
                break
        else:
            drafts = [0] * num
        if self.kind == "perturbed":
            start = len(tokens)  # wrong at every second position of the sequence
            drafts = [(t + 1) % VOCAB if (start + i) % 2 else t for i, t in enumerate(drafts)]
        return drafts


def install_proposer(llm: LLM, proposer: DraftProposer) -> None:
    """Make the (in-process, tp_size 1) engine draft with `proposer`."""
    llm.client.core.executor.worker.model_runner.proposer = proposer


def save_perturbed_copy(
    model: torch.nn.Module, path: Path, scale: float, seed: int = 5
) -> torch.nn.Module:
    """Save a copy of `model` with Gaussian noise of `scale` times each weight's spread added
    (a draft model close to the target: part of its drafts accepted); return the copy."""
    copy = deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():  # tied weights are one parameter
            spread = float(param.std()) if param.numel() > 1 else 0.0
            param.add_(torch.randn(param.shape, generator=generator) * spread * scale)
    copy.save_pretrained(path)  # type: ignore[operator]
    return copy

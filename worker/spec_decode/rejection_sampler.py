"""The verifier: which drafts to accept, and the token after them, exactly as the target model
would have sampled them one at a time.

For a request with drafts d1..dm and the target's distributions p0..pm at the verified rows
(p_j predicts the token after d_j; p0 the token after the last known one):

    greedy    accept d_{j+1} while it is argmax p_j; then emit argmax p_a (the first mismatch
              or, all accepted, the bonus token)
    random    accept d_{j+1} with probability min(1, p_j(d) / q_j(d)) (q: the draft's
              distribution; one-hot for drafts without one, so the probability is p_j(d));
              at the first rejection emit a token drawn from max(p_j - q_j, 0) normalised, or,
              all accepted, one drawn from p_m

which leaves every emitted token distributed exactly as p (Leviathan et al., 2023). Every row
draws its uniform and its residual token at once, from the request's own generator when seeded,
so a seeded request's tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.sampler import SamplingTensors, exponential_noise, sampling_probs


@dataclass(frozen=True)
class VerifyRows:
    """The verified rows of one step: `1 + num_drafts[i]` consecutive rows per request."""

    num_drafts: list[int]
    draft_ids: torch.Tensor  # [num_rows] int64: the draft each row checks (-1 on last rows)

    @classmethod
    def build(cls, drafts: Sequence[Sequence[int]], device: torch.device) -> VerifyRows:
        ids = [token for request in drafts for token in (*request, -1)]
        return cls([len(request) for request in drafts], torch.tensor(ids, device=device))


def target_probs(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """Per row, the distribution the sampler draws from (temperature, min-p, top-k, top-p);
    one-hot at the argmax on greedy rows. [num_rows, vocab] fp32."""
    probs = sampling_probs(logits, tensors)
    greedy = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
    return torch.where(tensors.is_greedy[:, None], greedy, probs)


def rejection_sample(
    probs: torch.Tensor,
    rows: VerifyRows,
    tensors: SamplingTensors,
    default: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> list[list[int]]:
    """Per request, the accepted drafts then the token after them (see the module docstring).

    `probs` [num_rows, vocab] from `target_probs`; `tensors` has one row per verified row;
    `draft_probs` [num_rows, vocab] the draft's distributions (None: one-hot drafts).
    """
    device = probs.device
    has_draft = rows.draft_ids >= 0
    drafts = rows.draft_ids.clamp(min=0)
    p_draft = probs.gather(1, drafts[:, None])[:, 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        residual = probs.scatter(1, drafts[:, None], 0.0)
    else:
        q_draft = draft_probs.gather(1, drafts[:, None])[:, 0]
        residual = (probs - draft_probs).clamp(min=0.0)
    residual = torch.where(has_draft[:, None], residual, probs)  # last rows: the bonus token
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, probs, residual)
    uniforms = _uniforms(len(rows.draft_ids), tensors.generators, default, device)
    accepted = has_draft & (uniforms * q_draft < p_draft)
    noise = exponential_noise(residual.shape, tensors.generators, default, device)
    emitted = (residual / noise).argmax(dim=-1)
    return _assemble(rows, accepted.tolist(), emitted.tolist())


def _uniforms(
    num_rows: int,
    generators: Sequence[torch.Generator | None],
    default: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """U[0, 1) per row; rows of seeded requests from their own generator."""
    values = torch.rand(num_rows, device=device, generator=default)
    for row, generator in enumerate(generators):
        if generator is not None:
            values[row] = torch.rand(1, device=device, generator=generator)[0]
    return values


def _assemble(rows: VerifyRows, accepted: list[bool], emitted: list[int]) -> list[list[int]]:
    out = []
    start = 0
    draft_ids = rows.draft_ids.tolist()
    for num in rows.num_drafts:
        num_accepted = 0
        while num_accepted < num and accepted[start + num_accepted]:
            num_accepted += 1
        tokens = draft_ids[start : start + num_accepted]
        tokens.append(emitted[start + num_accepted])
        out.append(tokens)
        start += num + 1
    return out

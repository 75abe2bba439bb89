"""Which rows each routed expert of a mixture-of-experts layer computes, eager or captured.

Eagerly, only the experts some token chose run, each on the rows that chose it (the shapes
depend on the routing, read on the host). A captured or traced forward (a CUDA graph,
`torch.compile`) cannot read the routing on the host: there every expert runs on every row
and rows that did not choose it get weight 0, which adds exactly nothing to their sums.

    eager:    for e in unique(chosen):  rows(e) = {t : e in chosen[t]},  weight[t, slot]
    captured: for e in range(E):        rows = all T,                    weight or 0
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch


class ExpertRoute(NamedTuple):
    """One expert's share of a step."""

    expert: int
    tokens: torch.Tensor
    """[n] int64 rows the expert computes."""
    weights: torch.Tensor
    """[n] each row's routing weight for the expert (0: not routed to it)."""


def is_static_forward() -> bool:
    """Whether the forward is traced by `torch.compile` or captured into a CUDA graph, so
    nothing may depend on tensor values read on the host."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def expert_routes(
    chosen: torch.Tensor, weights: torch.Tensor, num_experts: int, per_expert: bool = False
) -> Iterator[ExpertRoute]:
    """The experts to run and their rows: `chosen` [T, k] expert ids, `weights` [T, k] their
    routing weights (`per_expert`: [T, num_experts], one weight per expert)."""
    if is_static_forward():
        rows = torch.arange(chosen.shape[0], device=chosen.device)
        for expert in range(num_experts):
            hit = chosen == expert  # [T, k]
            if per_expert:
                weight = weights[:, expert] * hit.any(dim=-1).to(weights.dtype)
            else:
                weight = (weights * hit.to(weights.dtype)).sum(dim=-1)
            yield ExpertRoute(expert, rows, weight)
        return
    for expert in torch.unique(chosen).tolist():
        tokens, slot = torch.where(chosen == expert)
        weight = weights[tokens, expert] if per_expert else weights[tokens, slot]
        yield ExpertRoute(expert, tokens, weight)

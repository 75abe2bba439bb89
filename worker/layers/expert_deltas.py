"""Extra per-expert terms on stacked MoE expert weights (LoRA adapters fill them).

A module keeping its experts as stacked `[E, d1, d2]` parameters owns an `ExpertDeltas` and passes
every expert projection's output through `apply`; with nothing registered `apply` returns the
output unchanged. `peft_parameters` says how PEFT's `target_parameters` see those weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from worker.layers.loading import WeightLoader, weight_loader_of


@dataclass(frozen=True)
class PeftExpertParameter:
    """One stacked expert weight, as PEFT's `target_parameters` address it."""

    name: str
    """Our parameter's name on the experts module."""
    peft_transposed: bool
    """transformers' `is_transposed` of the experts module: PEFT reads the weight as
    [E, in, out] when set, else as [E, out, in]."""
    input_dim: int
    """Dimension of our [E, d1, d2] weight that the expert's input multiplies: 1 for
    `x @ W[e]`, 2 for `F.linear(x, W[e])`."""


class StackedWeight(NamedTuple):
    """This rank's [E, d1, d2] expert weight as PEFT sees it, and the loader cutting it."""

    shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    loader: WeightLoader


class ExpertDelta(Protocol):
    """One weight's extra term: `out` plus the delta of the rows `tokens` (batch rows) routed to
    `expert`, whose projection input is `x` ([len(tokens), in])."""

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, expert: int
    ) -> torch.Tensor: ...


class ExpertDeltas:
    """The extra terms registered on one experts module, by our parameter name."""

    def __init__(self, peft_parameters: dict[str, PeftExpertParameter], tp_size: int) -> None:
        self.peft_parameters = peft_parameters
        """transformers' parameter name -> ours, in transformers' registration order (the
        order PEFT nests its wrappers in)."""
        self.tp_size = tp_size
        """Ranks the experts' intermediate features are split over."""
        self.deltas: dict[str, ExpertDelta] = {}

    def apply(
        self, name: str, x: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, expert: int
    ) -> torch.Tensor:
        """`out` of weight `name` for `expert`, plus its registered delta if any."""
        delta = self.deltas.get(name)
        return out if delta is None else delta(x, out, tokens, expert)


def expert_deltas_of(module: object) -> ExpertDeltas | None:
    """The module's `expert_deltas`, if it keeps stacked experts."""
    deltas = getattr(module, "expert_deltas", None)
    return deltas if isinstance(deltas, ExpertDeltas) else None


def stacked_weight_of(module: object, name: str) -> StackedWeight:
    """Our stacked weight `name` of `module`: its parameter, or the module's `stacked_weight`
    view for experts kept as one module each."""
    view = getattr(module, "stacked_weight", None)
    if callable(view):
        weight: StackedWeight = view(name)
        return weight
    param = getattr(module, name)
    shape = (int(param.shape[0]), int(param.shape[1]), int(param.shape[2]))
    return StackedWeight(shape, param.dtype, param.device, weight_loader_of(param))

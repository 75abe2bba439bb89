"""Adapter slots on stacked MoE expert weights (PEFT's `target_parameters`).

PEFT's `ParamWrapper` keeps, for a weight of E experts and rank r, lora_A [r*E, in] (expert-major
rows) and lora_B [out, r*E] (rank-major columns: expert e's column j is j*E + e), with in/out as
PEFT reads the weight (`PeftExpertParameter.peft_transposed`). Its merged weight is

    W[e] += scaling * P[e] @ Q[e]    P [E, d1, r], Q [E, r, d2] in the weight's own [E, d1, d2]

which this module turns into each expert's A [r, in] and B [out, r] for the way the model applies
the weight, then cuts for this rank with the weight's own loader (the factor carrying the split
dimension goes through it). A token routed to expert e gets e's delta of its own adapter only,
before the model's routing weight, as in the merged model. With tensor parallelism the down
projection's delta is a partial sum like the base output's, so no extra all-reduce is needed.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.lora_reference import lora_segments
from worker.layers.expert_deltas import (
    ExpertDeltas,
    PeftExpertParameter,
    StackedWeight,
    stacked_weight_of,
)
from worker.layers.loading import ShardId
from worker.lora.layers import LoRAStep
from worker.lora.peft_files import LoRAWeights, PeftAdapter


def peft_factors(
    lora: LoRAWeights, num_experts: int, peft_transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P [E, d1, r], Q [E, r, d2]) with PEFT's merged delta of the stacked weight W[e] += P @ Q
    (scaling already in B)."""
    rank = lora.a.shape[0] // num_experts
    a = lora.a.reshape(num_experts, rank, lora.a.shape[1])  # [E, r, in]
    b = lora.b.reshape(lora.b.shape[0], rank, num_experts).permute(2, 0, 1)  # [E, out, r]
    if peft_transposed:  # weight [E, in, out]
        return a.transpose(1, 2), b.transpose(1, 2)
    return b, a  # weight [E, out, in]


class ExpertLoRALayer:
    """One stacked expert weight's adapter slots: A [slots, E, R, in], B [slots, E, out, R]."""

    def __init__(
        self,
        weight: StackedWeight,
        spec: PeftExpertParameter,
        num_slots: int,
        max_rank: int,
        step: LoRAStep,
    ) -> None:
        self.weight, self.spec, self.step = weight, spec, step
        num_experts = weight.shape[0]
        in_features = weight.shape[spec.input_dim]
        out_features = weight.shape[3 - spec.input_dim]
        self.lora_a = torch.zeros(
            (num_slots, num_experts, max_rank, in_features),
            dtype=weight.dtype,
            device=weight.device,
        )
        self.lora_b = torch.zeros(
            (num_slots, num_experts, out_features, max_rank),
            dtype=weight.dtype,
            device=weight.device,
        )

    def set_slot(self, slot: int, weights: dict[ShardId, LoRAWeights]) -> None:
        """Put an adapter's weights for this expert weight in `slot`."""
        self.clear_slot(slot)
        p, q = peft_factors(weights[None], self.weight.shape[0], self.spec.peft_transposed)
        p, q = self._cut(p, 1), self._cut(q, 2)
        rank = p.shape[2]
        if self.spec.input_dim == 1:  # x @ (W + P Q): shrink by P, expand by Q
            lora_a, lora_b = p.transpose(1, 2), q.transpose(1, 2)
        else:  # x @ (W + P Q)^T: shrink by Q, expand by P
            lora_a, lora_b = q, p
        self.lora_a[slot, :, :rank] = lora_a
        self.lora_b[slot, :, :, :rank] = lora_b

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def _cut(self, factor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's part of `factor` along `dim` (the weight's dim), by the weight's loader."""
        local = self.weight.shape[dim]
        if factor.shape[dim] == local:
            return factor.to(self.lora_a)
        shape = list(factor.shape)
        shape[dim] = local
        target = nn.Parameter(torch.zeros(shape).to(self.lora_a), requires_grad=False)
        self.weight.loader(target, factor, None)
        return target.data

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor, tokens: torch.Tensor, expert: int
    ) -> torch.Tensor:
        """`out` plus each routed row's delta from its own adapter (rows of no adapter: none)."""
        token_slots = self.step.token_slots()
        if token_slots is None:
            return out
        segments = lora_segments(token_slots[tokens], x.device)
        if segments is None:
            return out
        kernels = self.step.kernels
        shrunk = kernels.shrink(x, self.lora_a[:, expert], segments)
        return kernels.expand(out, shrunk, self.lora_b[:, expert], segments)


def expert_parameter(
    adapter: PeftAdapter, hf_module: str, module: nn.Module, deltas: ExpertDeltas, lora: LoRAWeights
) -> PeftExpertParameter:
    """Which stacked expert weight of `module` (its `deltas`) the adapter's wrapper `hf_module`
    (PEFT's name, `.base_layer` once per nesting level) adapts; ValueError naming the adapter
    if none fits."""
    base = hf_module.replace(".base_layer", "")
    depth = hf_module.count(".base_layer")
    targeted = [  # PEFT wraps in registration order: the last one is the outermost wrapper
        hf_param
        for hf_param in deltas.peft_parameters
        if any(
            f"{base}.{hf_param}" == target or f"{base}.{hf_param}".endswith(f".{target}")
            for target in adapter.target_parameters
        )
    ]
    if depth >= len(targeted):
        raise ValueError(
            f"LoRA adapter {adapter.name!r} targets expert parameters "
            f"{list(adapter.target_parameters)} of {base!r}, which this model does not have "
            f"(it adapts {list(deltas.peft_parameters)})"
        )
    hf_param = targeted[len(targeted) - 1 - depth]
    spec = deltas.peft_parameters[hf_param]
    weight = stacked_weight_of(module, spec.name)
    _check_shape(adapter, f"{base}.{hf_param}", weight, spec, lora, deltas.tp_size)
    return spec


def _check_shape(
    adapter: PeftAdapter,
    hf_name: str,
    weight: StackedWeight,
    spec: PeftExpertParameter,
    lora: LoRAWeights,
    tp_size: int,
) -> None:
    """The adapter's A and B fit the stacked weight (whole, or cut in `tp_size` parts)."""
    num_experts = weight.shape[0]
    fits = lora.a.shape[0] == adapter.rank * num_experts
    if fits:
        p, q = peft_factors(lora, num_experts, spec.peft_transposed)
        fits = all(
            full in (weight.shape[dim], weight.shape[dim] * tp_size)
            for dim, full in ((1, p.shape[1]), (2, q.shape[2]))
        )
    if not fits:
        raise ValueError(
            f"LoRA adapter {adapter.name!r}: {hf_name} has lora_A {tuple(lora.a.shape)} and "
            f"lora_B {tuple(lora.b.shape)}, which do not fit {num_experts} experts of "
            f"{tuple(weight.shape)} at rank r={adapter.rank}"
        )

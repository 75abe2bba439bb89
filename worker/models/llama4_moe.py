"""Llama 4's mixture of experts: sigmoid-scored top-k routing plus a shared expert.

Each token goes to its top-k experts with its input scaled by sigmoid(router logit); the routed
outputs are summed and added to the shared expert's output (transformers' `Llama4TextMoe`).
Expert weights are stacked `[E, ...]` tensors; their intermediate size is split over ranks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from worker.config import ParallelConfig
from worker.distributed import all_reduce
from worker.layers.activation import gated_activation
from worker.layers.expert_deltas import ExpertDeltas, PeftExpertParameter
from worker.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from worker.layers.loading import ShardId, WeightSource, copy_checked, new_parameter, read_part
from worker.models.expert_routes import expert_routes


class Llama4MLP(nn.Module):
    """Gated MLP (dense layers and the MoE's shared expert)."""

    def __init__(self, hidden: int, inner: int, act: str, parallel: ParallelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inner, inner], parallel)
        self.act = gated_activation(act)
        self.down_proj = RowParallelLinear(inner, hidden, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class Llama4Experts(nn.Module):
    """Routed experts: `gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H], I split over ranks."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        num, hidden = hf_config.num_local_experts, hf_config.hidden_size
        self.inner = hf_config.intermediate_size
        self.inner_per_rank = divide(self.inner, parallel.tp_size, "intermediate_size")
        self.parallel = parallel
        self.gate_up_proj = new_parameter((num, hidden, 2 * self.inner_per_rank), self.load_gate_up)
        self.down_proj = new_parameter((num, self.inner_per_rank, hidden), self.load_down)
        self.act = gated_activation(hf_config.hidden_act)
        self.expert_deltas = ExpertDeltas(  # transformers' experts have no `is_transposed`
            {
                "gate_up_proj": PeftExpertParameter("gate_up_proj", False, 1),
                "down_proj": PeftExpertParameter("down_proj", False, 1),
            },
            parallel.tp_size,
        )

    def load_gate_up(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's gate columns and up columns of every expert."""
        start, size = self.parallel.rank * self.inner_per_rank, self.inner_per_rank
        gate = read_part(source, 2, start, size)
        up = read_part(source, 2, self.inner + start, size)
        copy_checked(param.data, torch.cat([gate, up], dim=2))

    def load_down(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's input rows of every expert's down projection."""
        size = self.inner_per_rank
        copy_checked(param.data, read_part(source, 1, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts e of expert_e(x * scores[:, e])."""
        out = torch.zeros_like(x)
        num_experts = self.gate_up_proj.shape[0]
        for expert, tokens, score in expert_routes(chosen, scores, num_experts, per_expert=True):
            routed = x[tokens] * score[:, None]
            gate_up = routed @ self.gate_up_proj[expert]
            gate_up = self.expert_deltas.apply("gate_up_proj", routed, gate_up, tokens, expert)
            inner = self.act(gate_up)
            down = self.expert_deltas.apply(
                "down_proj", inner, inner @ self.down_proj[expert], tokens, expert
            )
            out.index_add_(0, tokens, down)
        return all_reduce(out) if self.parallel.tp_size > 1 else out


class Llama4MoE(nn.Module):
    """Sigmoid-scored top-k routing over the experts, plus a shared expert on every token."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.top_k = hf_config.num_experts_per_tok
        self.router = ReplicatedLinear(hf_config.hidden_size, hf_config.num_local_experts)
        self.experts = Llama4Experts(hf_config, parallel)
        self.shared_expert = Llama4MLP(
            hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, parallel
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # [T, E]
        top_logits, chosen = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, chosen, top_logits)
        scores = torch.sigmoid(scores.float()).to(x.dtype)
        out: torch.Tensor = self.shared_expert(x) + self.experts(x, scores, chosen)
        return out

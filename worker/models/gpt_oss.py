"""gpt-oss: alternating sliding-window (128) and full layers, attention sinks, YaRN rope and a
mixture of experts with a clamped, biased SwiGLU.

Everything but the feed-forward block is the shared decoder (qkv and output biases, one rope
table, per-layer windows from `layer_types`, per-head `sinks`). Each token goes to its top-k
experts (router with bias; softmax over the chosen logits); an expert computes
`(clamp(up) + 1) * g * sigmoid(alpha * g)` with `g = clamp(gate, max=limit)`, gate and up
interleaved in `gate_up_proj` (transformers' `GptOssExperts`). Tensor parallelism splits query
and KV heads (and their sinks) and every expert's intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from worker.config import ParallelConfig
from worker.distributed import all_reduce
from worker.layers.expert_deltas import ExpertDeltas, PeftExpertParameter
from worker.layers.linear import divide
from worker.layers.loading import (
    ShardId,
    WeightSource,
    copy_checked,
    default_weight_loader,
    new_parameter,
    read_part,
)
from worker.models.decoder import (
    DecoderForCausalLM,
    DecoderOptions,
    LayerOptions,
    head_size_of,
    window_from_layer_types,
)


class GptOssExperts(nn.Module):
    """Stacked experts: `gate_up_proj` [E, H, 2I] (gate, up interleaved), `down_proj` [E, I, H],
    with biases; this rank holds intermediate features [rank * I/tp, (rank + 1) * I/tp)."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        num, hidden = hf_config.num_local_experts, hf_config.hidden_size
        inner = divide(hf_config.intermediate_size, parallel.tp_size, "intermediate_size")
        self.inner_per_rank, self.parallel = inner, parallel
        self.alpha, self.limit = float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)
        self.gate_up_proj = new_parameter((num, hidden, 2 * inner), self.load_gate_up)
        self.gate_up_proj_bias = new_parameter((num, 2 * inner), self.load_gate_up)
        self.down_proj = new_parameter((num, inner, hidden), self.load_down)
        self.down_proj_bias = new_parameter((num, hidden), default_weight_loader)
        self.expert_deltas = ExpertDeltas(
            {
                "gate_up_proj": PeftExpertParameter("gate_up_proj", True, 1),
                "down_proj": PeftExpertParameter("down_proj", True, 1),
            },
            parallel.tp_size,
        )

    def load_gate_up(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """Interleaved gate/up columns of this rank's features: one contiguous range."""
        size = 2 * self.inner_per_rank
        dim = param.dim() - 1
        copy_checked(param.data, read_part(source, dim, self.parallel.rank * size, size))

    def load_down(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's input rows of every expert's down projection."""
        size = self.inner_per_rank
        copy_checked(param.data, read_part(source, 1, self.parallel.rank * size, size))

    def _expert(self, x: torch.Tensor, tokens: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` on the batch rows `tokens` of x."""
        routed = x[tokens]
        gate_up = routed @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
        gate_up = self.expert_deltas.apply("gate_up_proj", routed, gate_up, tokens, expert)
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        inner = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        out = self.expert_deltas.apply(
            "down_proj", inner, inner @ self.down_proj[expert], tokens, expert
        )
        if self.parallel.rank == 0:  # the bias once, before the sum over ranks
            out = out + self.down_proj_bias[expert]
        return out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, k] -> sum of weighted expert outputs."""
        out = torch.zeros_like(x)
        for expert in torch.unique(chosen).tolist():
            tokens, slot = torch.where(chosen == expert)
            routed = self._expert(x, tokens, expert) * weights[tokens, slot, None]
            out.index_add_(0, tokens, routed.to(out.dtype))
        return all_reduce(out) if self.parallel.tp_size > 1 else out


class GptOssRouter(nn.Module):
    """Linear router with bias; softmax over each token's top-k logits."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        num, hidden = hf_config.num_local_experts, hf_config.hidden_size
        self.top_k = hf_config.num_experts_per_tok
        self.weight = new_parameter((num, hidden), default_weight_loader)
        self.bias = new_parameter((num,), default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=1), chosen


class GptOssMoE(nn.Module):
    """gpt-oss's feed-forward block (`mlp.router`, `mlp.experts`)."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.router = GptOssRouter(hf_config)
        self.experts = GptOssExperts(hf_config, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x)
        out: torch.Tensor = self.experts(x, weights, chosen)
        return out


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss causal LM (`GptOssForCausalLM` / `GptOssConfig`)."""

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return DecoderOptions(
            hidden_act="silu",  # unused: every layer's feed-forward block is the MoE
            attn_scale=head_size_of(hf_config) ** -0.5,
            qkv_bias=bias,
            o_bias=bias,
            attention_sinks=True,
        )

    def layer_options(self, hf_config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        return LayerOptions(sliding_window=window_from_layer_types(hf_config, layer_idx))

    def build_mlp(
        self, hf_config: PretrainedConfig, layer_idx: int, parallel: ParallelConfig
    ) -> nn.Module:
        return GptOssMoE(hf_config, parallel)

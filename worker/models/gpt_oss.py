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

import itertools
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels.batch_invariant import TORCH_MATH, LayerMath
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
from worker.models.expert_routes import expert_routes

if TYPE_CHECKING:
    from worker.quantization.execution import QuantizedWeights


class GptOssExperts(nn.Module):
    """Stacked experts: `gate_up_proj` [E, H, 2I] (gate, up interleaved), `down_proj` [E, I, H],
    with biases; this rank holds intermediate features [rank * I/tp, (rank + 1) * I/tp).
    An MXFP4 checkpoint's experts may stay quantized (`quantized`), run by the MoE kernel."""

    quantized_params = ("gate_up_proj", "down_proj")

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""
        num, hidden = hf_config.num_local_experts, hf_config.hidden_size
        inner = divide(hf_config.intermediate_size, parallel.tp_size, "intermediate_size")
        self.inner_per_rank, self.parallel = inner, parallel
        self.alpha, self.limit = float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)
        self.gate_up_proj = new_parameter((num, hidden, 2 * inner), self.load_gate_up)
        self.gate_up_proj_bias = new_parameter((num, 2 * inner), self.load_gate_up)
        self.down_proj = new_parameter((num, inner, hidden), self.load_down)
        self.down_proj_bias = new_parameter((num, hidden), default_weight_loader)
        self.quantized: QuantizedWeights | None = None
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
        start = self.parallel.rank * size
        if self._offer(param, source, rows=(start, size)):
            return
        dim = param.dim() - 1
        copy_checked(param.data, read_part(source, dim, self.parallel.rank * size, size))

    def load_down(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's input rows of every expert's down projection."""
        size = self.inner_per_rank
        if self._offer(param, source, cols=(self.parallel.rank * size, size)):
            return
        copy_checked(param.data, read_part(source, 1, self.parallel.rank * size, size))

    def _offer(self, param: nn.Parameter, source: WeightSource, **cut: tuple[int, int]) -> bool:
        """Whether the quantized experts took `source` (a weight, not a bias)."""
        names = {id(self.gate_up_proj): "gate_up_proj", id(self.down_proj): "down_proj"}
        name = names.get(id(param))
        if self.quantized is None or name is None:
            return False
        return self.quantized.take(name, param, source, **cut)  # type: ignore[arg-type]

    def _expert(self, x: torch.Tensor, tokens: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert `expert` on the batch rows `tokens` of x."""
        routed = x[tokens]
        math = self.math
        gate_up = math.matmul(routed, self.gate_up_proj[expert]) + self.gate_up_proj_bias[expert]
        gate_up = self.expert_deltas.apply("gate_up_proj", routed, gate_up, tokens, expert)
        inner = self._activation(gate_up)
        out = self.expert_deltas.apply(
            "down_proj", inner, math.matmul(inner, self.down_proj[expert]), tokens, expert
        )
        if self.parallel.rank == 0:  # the bias once, before the sum over ranks
            out = out + self.down_proj_bias[expert]
        return out

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * self.math.pointwise(torch.sigmoid, gate * self.alpha)

    def _grouped(
        self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, kernel: QuantizedWeights
    ) -> torch.Tensor:
        """Every (token, choice) pair sorted by expert through the grouped MoE kernel."""
        order = torch.argsort(chosen.reshape(-1), stable=True)
        tokens = order // chosen.shape[1]
        flat = chosen.reshape(-1)
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))  # no host sync, unlike bincount
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        routed = x[tokens]
        gate_up = kernel.experts("gate_up_proj", routed, offsets, self.gate_up_proj_bias)
        gate_up = self._expert_deltas("gate_up_proj", routed, gate_up, tokens, offsets)
        inner = self._activation(gate_up)
        bias = self.down_proj_bias if self.parallel.rank == 0 else None
        out = kernel.experts("down_proj", inner, offsets, bias)
        out = self._expert_deltas("down_proj", inner, out, tokens, offsets)
        summed = torch.zeros_like(x)
        summed.index_add_(0, tokens, (out * weights.reshape(-1)[order, None]).to(x.dtype))
        return all_reduce(summed) if self.parallel.tp_size > 1 else summed

    def _expert_deltas(
        self,
        name: str,
        x: torch.Tensor,
        out: torch.Tensor,
        tokens: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        """Adapters' terms on each expert's rows (nothing to do without adapters)."""
        if name not in self.expert_deltas.deltas:
            return out
        bounds = offsets.tolist()
        pieces = [
            self.expert_deltas.apply(name, x[a:b], out[a:b], tokens[a:b], expert)
            for expert, (a, b) in enumerate(itertools.pairwise(bounds))
        ]
        return torch.cat(pieces)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, k] -> sum of weighted expert outputs."""
        if self.quantized is not None:
            return self._grouped(x, weights, chosen, self.quantized)
        out = torch.zeros_like(x)
        for expert, tokens, weight in expert_routes(chosen, weights, self.gate_up_proj.shape[0]):
            routed = self._expert(x, tokens, expert) * weight[:, None]
            out.index_add_(0, tokens, routed.to(out.dtype))
        return all_reduce(out) if self.parallel.tp_size > 1 else out


class GptOssRouter(nn.Module):
    """Linear router with bias; softmax over each token's top-k logits."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""
        num, hidden = hf_config.num_local_experts, hf_config.hidden_size
        self.top_k = hf_config.num_experts_per_tok
        self.weight = new_parameter((num, hidden), default_weight_loader)
        self.bias = new_parameter((num,), default_weight_loader)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.math.linear(x, self.weight, self.bias)  # [T, E]
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

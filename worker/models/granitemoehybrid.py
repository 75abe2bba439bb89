"""GraniteMoeHybrid (Granite 4.0-H): Mamba-2 and attention layers, MoE plus a shared MLP.

Every layer: x + m * mixer(norm(x)), then x + m * (moe(norm(x)) + shared_mlp(norm(x))) (dense
variants have no MoE). Embeddings are multiplied by `embedding_multiplier`, attention scores by
`attention_multiplier`, logits divided by `logits_scaling`; rope only when
`position_embedding_type == "rope"`. MoE: softmax over the top-k router logits; expert weights
`input_linear` [E, 2I, H] (gate rows then up rows) and `output_linear` [E, H, I], I split over
ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, rope_parameters
from worker.models.bamba import mamba_sizes
from worker.models.decoder import DecoderOptions, LayerOptions, head_size_of
from worker.models.expert_routes import expert_routes
from worker.models.mamba_hybrid import (
    ATTENTION,
    HybridAttention,
    HybridForCausalLM,
    HybridLayerSpec,
    HybridModel,
    build_layers,
    build_mamba,
)


class GraniteSharedMLP(nn.Module):
    """Gated MLP whose checkpoint keeps gate and up in one `input_linear` [2I, H]."""

    def __init__(self, hidden: int, inner: int, act: str, parallel: ParallelConfig) -> None:
        super().__init__()
        self.input_linear = MergedColumnParallelLinear(hidden, [inner, inner], parallel)
        self.input_linear.weight.weight_loader = self._load_input  # type: ignore[attr-defined]
        self.act = gated_activation(act)
        self.output_linear = RowParallelLinear(inner, hidden, parallel)
        self.inner = inner

    def _load_input(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        size = self.input_linear.output_sizes_per_rank[0]
        start = self.input_linear.parallel.rank * size
        gate = read_part(source, 0, start, size)
        up = read_part(source, 0, self.inner + start, size)
        copy_checked(param.data, torch.cat([gate, up]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.output_linear(self.act(self.input_linear(x)))
        return out


class GraniteExperts(nn.Module):
    """Routed experts [E, 2I, H] and [E, H, I], this rank's share of I."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        num, hidden = hf_config.num_local_experts, hf_config.hidden_size
        self.inner = hf_config.intermediate_size
        self.per_rank = divide(self.inner, parallel.tp_size, "intermediate_size")
        self.parallel = parallel
        self.input_linear = new_parameter((num, 2 * self.per_rank, hidden), self._load_input)
        self.output_linear = new_parameter((num, hidden, self.per_rank), self._load_output)
        self.act = gated_activation(hf_config.hidden_act)
        self.expert_deltas = ExpertDeltas(  # transformers' `gate_up_proj` / `down_proj`
            {
                "gate_up_proj": PeftExpertParameter("input_linear", False, 2),
                "down_proj": PeftExpertParameter("output_linear", False, 2),
            },
            parallel.tp_size,
        )

    def _load_input(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        start = self.parallel.rank * self.per_rank
        gate = read_part(source, 1, start, self.per_rank)
        up = read_part(source, 1, self.inner + start, self.per_rank)
        copy_checked(param.data, torch.cat([gate, up], dim=1))

    def _load_output(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        start = self.parallel.rank * self.per_rank
        copy_checked(param.data, read_part(source, 2, start, self.per_rank))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts e of weight_e * expert_e(x)."""
        out = torch.zeros_like(x)
        for expert, tokens, weight in expert_routes(chosen, weights, self.input_linear.shape[0]):
            routed = x[tokens]
            gate_up = F.linear(routed, self.input_linear[expert])
            inner = self.act(
                self.expert_deltas.apply("input_linear", routed, gate_up, tokens, expert)
            )
            hidden = F.linear(inner, self.output_linear[expert])
            hidden = self.expert_deltas.apply("output_linear", inner, hidden, tokens, expert)
            out.index_add_(0, tokens, hidden * weight[:, None])
        return all_reduce(out) if self.parallel.tp_size > 1 else out


class GraniteRouter(nn.Module):
    """The router's `layer` [E, H] (checkpoint name `router.layer.weight`)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.layer = ReplicatedLinear(hidden, num_experts)


class GraniteSparseMoE(nn.Module):
    """Router and routed experts (checkpoint prefix `block_sparse_moe.`)."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.top_k = hf_config.num_experts_per_tok
        self.router = GraniteRouter(hf_config.hidden_size, hf_config.num_local_experts)
        self.experts = GraniteExperts(hf_config, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router.layer(x).float()
        top_logits, chosen = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        routed: torch.Tensor = self.experts(x, weights, chosen)
        return routed


class GraniteMoE(nn.Module):
    """Top-k routing (softmax over the chosen logits) plus the shared MLP."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.block_sparse_moe = (
            GraniteSparseMoE(hf_config, parallel) if hf_config.num_local_experts > 0 else None
        )
        self.shared_mlp = GraniteSharedMLP(
            hf_config.hidden_size,
            hf_config.shared_intermediate_size,
            hf_config.hidden_act,
            parallel,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared: torch.Tensor = self.shared_mlp(x)
        if self.block_sparse_moe is None:
            return shared
        routed: torch.Tensor = self.block_sparse_moe(x)
        return routed + shared


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    """transformers' `GraniteMoeHybridForCausalLM` (MoE and dense Granite 4.0-H)."""

    renames = (
        (".block_sparse_moe.input_linear.weight", ".ffn.block_sparse_moe.experts.input_linear"),
        (".block_sparse_moe.output_linear.weight", ".ffn.block_sparse_moe.experts.output_linear"),
        (".block_sparse_moe.router.", ".ffn.block_sparse_moe.router."),
        (".shared_mlp.", ".ffn.shared_mlp."),
        (".block_sparse_moe.experts.weight", ".ffn.block_sparse_moe.experts.weight"),  # adapters
    )

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(
            hidden_act=hf_config.hidden_act,
            attn_scale=float(hf_config.attention_multiplier),
            qkv_bias=bool(hf_config.attention_bias),
            o_bias=bool(hf_config.attention_bias),
        )

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        self.logits_divisor = float(hf_config.logits_scaling or 1.0)
        kinds = hf_config.layer_types
        specs = [
            HybridLayerSpec.state_or_attention(
                kind in ("mamba", "linear_attention"),
                "mamba",
                "input_layernorm",
                "ffn",
                "post_attention_layernorm",
            )
            for kind in kinds
        ]
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size

        def modules(idx: int, spec: HybridLayerSpec) -> dict[str, nn.Module]:
            mixer: nn.Module
            if spec.kind == ATTENTION:
                mixer = HybridAttention(hf_config, self.options, LayerOptions(), idx, parallel)
            else:
                mixer = build_mamba(hf_config, idx, mamba_sizes(hf_config), parallel)
            return {
                "input_layernorm": RMSNorm(hidden, eps),
                spec.mixer_name: mixer,
                "post_attention_layernorm": RMSNorm(hidden, eps),
                "ffn": GraniteMoE(hf_config, parallel),
            }

        rotary = None
        if hf_config.position_embedding_type == "rope":
            rotary = RotaryEmbedding(head_size_of(hf_config), rope_parameters(hf_config))
        layers = build_layers(specs, modules, float(hf_config.residual_multiplier))
        return HybridModel(
            hf_config, layers, parallel, rotary, eps, float(hf_config.embedding_multiplier)
        )

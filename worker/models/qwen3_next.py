"""Qwen3-Next and Qwen3.5 (dense and MoE text models): gated DeltaNet layers with one gated
full-attention layer in every `full_attention_interval` (per `layer_types`).

Every layer: x + mixer(norm(x)), then x + ffn(norm(x)); norms scale by (1 + w). The mixer is
a gated DeltaNet (`linear_attn`) or gated attention (`self_attn`: q_proj yields a query and a
gate per head; q/k RMSNorm, partial rope, output * sigmoid(gate)). The ffn (`mlp`) is a gated
MLP or the sparse MoE with a gated shared expert. Qwen3.5 uses multimodal rope, which for text
(the same position on every axis) is plain rope; its multimodal checkpoints (the text model's
weights under `model.language_model.`) take images in `qwen3_5_vision`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels.batch_invariant import TORCH_MATH, LayerMath
from scheduler.kv_cache.linear_state_spec import GatedDeltaNetShape
from worker.attention.attention import ForwardContext
from worker.config import ParallelConfig
from worker.layers.linear import QKVParallelLinear
from worker.layers.loading import WeightSource
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RopeTables, RotaryEmbedding, rope_parameters, rotate_in_place
from worker.models.decoder import DecoderOptions, LayerOptions, head_size_of, layer_prefix
from worker.models.llama4_moe import Llama4MLP as GatedMLP
from worker.models.mamba_hybrid import (
    ATTENTION,
    HybridAttention,
    HybridForCausalLM,
    HybridLayerSpec,
    HybridModel,
    build_layers,
)
from worker.models.qwen_next_moe import QwenSparseMoE, split_stacked_experts
from worker.state.gated_delta_net import GatedDeltaNet, GatedDeltaNetConfig

LINEAR_ATTENTION = "linear_attention"


class GatedAttention(HybridAttention):
    """Attention whose query projection also yields a sigmoid output gate per head."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        options: DecoderOptions,
        layer_idx: int,
        parallel: ParallelConfig,
    ) -> None:
        super().__init__(hf_config, options, LayerOptions(), layer_idx, parallel)
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""
        heads = hf_config.num_attention_heads
        kv_heads = hf_config.num_key_value_heads
        # q_proj rows per head: [query (D) | gate (D)], so 2H "heads" of size D split evenly.
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size,
            head_size_of(hf_config),
            2 * heads,
            kv_heads,
            parallel,
            bias=options.qkv_bias,
        )

    def forward(
        self, hidden: torch.Tensor, rope: RopeTables | None, ctx: ForwardContext
    ) -> torch.Tensor:
        num_tokens, head_size = hidden.shape[0], self.qkv_proj.head_size
        query_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, gate = query_gate.view(num_tokens, -1, 2 * head_size).chunk(2, dim=-1)
        assert self.q_norm is not None
        assert self.k_norm is not None
        q, k = self.q_norm(q), self.k_norm(k.view(num_tokens, -1, head_size))
        if rope is not None:
            rotate_in_place(q, rope, self.kernels)
            rotate_in_place(k, rope, self.kernels)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, ctx)
        gated = out * self.math.pointwise(torch.sigmoid, gate.reshape(num_tokens, -1))
        projected: torch.Tensor = self.o_proj(gated)
        return projected


def delta_net_config(
    hf_config: PretrainedConfig, layer_idx: int, fused: bool
) -> GatedDeltaNetConfig:
    """Layer `layer_idx`'s gated DeltaNet sizes from the `linear_*` config keys."""
    return GatedDeltaNetConfig(
        layer_name=f"{layer_prefix(layer_idx)}linear_attn",
        hidden_size=hf_config.hidden_size,
        shape=GatedDeltaNetShape(
            num_k_heads=hf_config.linear_num_key_heads,
            num_v_heads=hf_config.linear_num_value_heads,
            head_k_dim=hf_config.linear_key_head_dim,
            head_v_dim=hf_config.linear_value_head_dim,
            conv_width=hf_config.linear_conv_kernel_dim,
        ),
        norm_eps=hf_config.rms_norm_eps,
        fused_projections=fused,
    )


class Qwen3NextForCausalLM(HybridForCausalLM):
    """transformers' `Qwen3NextForCausalLM`."""

    fused_projections = True
    """Checkpoints keep `in_proj_qkvz` / `in_proj_ba` (Qwen3.5: four projections)."""
    renames = (("model.language_model.", "model."),)
    """A multimodal checkpoint's text model."""
    skipped_prefixes: tuple[str, ...] = ("mtp.", "model.visual.")
    """The multi-token-prediction head and the vision encoder: not served."""
    default_mrope_section: tuple[int, ...] | None = None
    """M-RoPE's [t, h, w] frequencies when the config names none (None: plain rope only)."""

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        kept = (
            (name, source) for name, source in weights if not name.startswith(self.skipped_prefixes)
        )
        return super().load_weights(split_stacked_experts(kept))

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(
            hidden_act=hf_config.hidden_act,
            attn_scale=head_size_of(hf_config) ** -0.5,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
            o_bias=bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=True,
            gemma_norm=True,
        )

    def is_moe_layer(self, hf_config: PretrainedConfig, layer_idx: int) -> bool:
        """Qwen3-Next: MoE every `decoder_sparse_step` layers, except `mlp_only_layers`."""
        if layer_idx in (getattr(hf_config, "mlp_only_layers", None) or ()):
            return False
        step = getattr(hf_config, "decoder_sparse_step", 1)
        return bool(hf_config.num_experts > 0 and (layer_idx + 1) % step == 0)

    def norm_topk_prob(self, hf_config: PretrainedConfig) -> bool:
        return bool(hf_config.norm_topk_prob)

    def build_ffn(
        self, hf_config: PretrainedConfig, idx: int, parallel: ParallelConfig
    ) -> nn.Module:
        if self.is_moe_layer(hf_config, idx):
            return QwenSparseMoE(hf_config, parallel, self.norm_topk_prob(hf_config))
        return GatedMLP(
            hf_config.hidden_size, hf_config.intermediate_size, hf_config.hidden_act, parallel
        )

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        kinds = list(hf_config.layer_types)
        specs = [
            HybridLayerSpec.state_or_attention(
                kind == LINEAR_ATTENTION,
                "linear_attn",
                "input_layernorm",
                "mlp",
                "post_attention_layernorm",
            )
            for kind in kinds
        ]
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size

        def modules(idx: int, spec: HybridLayerSpec) -> dict[str, nn.Module]:
            mixer: nn.Module
            if spec.kind == ATTENTION:
                mixer = GatedAttention(hf_config, self.options, idx, parallel)
            else:
                cfg = delta_net_config(hf_config, idx, self.fused_projections)
                mixer = GatedDeltaNet(cfg, parallel)
            return {
                "input_layernorm": RMSNorm(hidden, eps, add_unit_offset=True),
                spec.mixer_name: mixer,
                "post_attention_layernorm": RMSNorm(hidden, eps, add_unit_offset=True),
                "mlp": self.build_ffn(hf_config, idx, parallel),
            }

        rope = rope_parameters(hf_config)
        if self.default_mrope_section is not None:
            rope.setdefault("mrope_section", list(self.default_mrope_section))
        rotary = RotaryEmbedding(head_size_of(hf_config), rope)
        model = HybridModel(hf_config, build_layers(specs, modules), parallel, rotary, eps)
        model.norm = RMSNorm(hidden, eps, add_unit_offset=True)
        return model


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """transformers' `Qwen3_5ForCausalLM` (dense text model)."""

    fused_projections = False

    def is_moe_layer(self, hf_config: PretrainedConfig, layer_idx: int) -> bool:
        return False


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """transformers' `Qwen3_5MoeForCausalLM` (MoE text model): every layer is MoE."""

    fused_projections = False

    def is_moe_layer(self, hf_config: PretrainedConfig, layer_idx: int) -> bool:
        return True

    def norm_topk_prob(self, hf_config: PretrainedConfig) -> bool:
        return True

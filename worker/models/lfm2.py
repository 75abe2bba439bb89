"""LFM2: short-convolution blocks with a few attention layers (per `layer_types`), a gated MLP
in every layer.

Every layer: x + op(operator_norm(x)), then x + feed_forward(ffn_norm(x)); op is the short
convolution (`conv`) or attention (`self_attn`: q/k RMSNorm per head, rope, `out_proj`). The
final norm is called `embedding_norm` in checkpoints. The MLP's width is `intermediate_size`,
or 2/3 of it (rounded up to `block_multiple_of` after `block_ffn_dim_multiplier`) when
`block_auto_adjust_ff_dim`.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from worker.config import ParallelConfig
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, rope_parameters
from worker.models.decoder import (
    DecoderAttention,
    DecoderOptions,
    LayerOptions,
    head_size_of,
    layer_prefix,
)
from worker.models.llama4_moe import Llama4MLP as GatedMLP
from worker.models.mamba_hybrid import (
    ATTENTION,
    HybridForCausalLM,
    HybridLayerSpec,
    HybridModel,
    build_layers,
)
from worker.state.short_conv import ShortConv, ShortConvConfig


def feed_forward_size(hf_config: PretrainedConfig) -> int:
    """The MLP's intermediate size after LFM2's automatic adjustment."""
    size = int(hf_config.intermediate_size)
    if not getattr(hf_config, "block_auto_adjust_ff_dim", False):
        return size
    size = int(2 * size / 3)
    multiplier = getattr(hf_config, "block_ffn_dim_multiplier", None)
    if multiplier is not None:
        size = int(multiplier * size)
        multiple = int(hf_config.block_multiple_of)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def lfm2_attention(
    hf_config: PretrainedConfig, options: DecoderOptions, idx: int, parallel: ParallelConfig
) -> DecoderAttention:
    """Attention with per-head q/k RMSNorm (whose epsilon is LFM2's `norm_eps`)."""
    attention = DecoderAttention(hf_config, options, LayerOptions(), idx, parallel)
    head_size = head_size_of(hf_config)
    attention.q_norm = RMSNorm(head_size, hf_config.norm_eps)
    attention.k_norm = RMSNorm(head_size, hf_config.norm_eps)
    return attention


class Lfm2ForCausalLM(HybridForCausalLM):
    """transformers' `Lfm2ForCausalLM`."""

    tie_word_embeddings_default = True
    renames = (
        ("model.embedding_norm.", "model.norm."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".feed_forward.w1.", ".feed_forward.gate_proj."),
        (".feed_forward.w3.", ".feed_forward.up_proj."),
        (".feed_forward.w2.", ".feed_forward.down_proj."),
    )

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(hidden_act="silu", attn_scale=head_size_of(hf_config) ** -0.5)

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        specs = [
            HybridLayerSpec.state_or_attention(
                kind == "conv", "conv", "operator_norm", "feed_forward", "ffn_norm"
            )
            for kind in hf_config.layer_types
        ]
        eps, hidden = hf_config.norm_eps, hf_config.hidden_size

        def modules(idx: int, spec: HybridLayerSpec) -> dict[str, nn.Module]:
            mixer: nn.Module
            if spec.kind == ATTENTION:
                mixer = lfm2_attention(hf_config, self.options, idx, parallel)
            else:
                cfg = ShortConvConfig(
                    f"{layer_prefix(idx)}conv", hidden, hf_config.conv_L_cache,
                    bool(hf_config.conv_bias),
                )  # fmt: skip
                mixer = ShortConv(cfg, parallel)
            return {
                "operator_norm": RMSNorm(hidden, eps),
                spec.mixer_name: mixer,
                "ffn_norm": RMSNorm(hidden, eps),
                "feed_forward": GatedMLP(hidden, feed_forward_size(hf_config), "silu", parallel),
            }

        rotary = RotaryEmbedding(head_size_of(hf_config), rope_parameters(hf_config))
        return HybridModel(hf_config, build_layers(specs, modules), parallel, rotary, eps)

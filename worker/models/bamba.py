"""Bamba: Mamba-2 layers with a few attention layers (partial rope), a gated MLP in every layer.

Layer i is attention when `i in attn_layer_indices`, else Mamba-2; both are followed by
`pre_ff_layernorm` and the gated `feed_forward` MLP. Rope rotates half of each head.
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from worker.config import ParallelConfig
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, rope_parameters
from worker.models.decoder import DecoderMLP, DecoderOptions, LayerOptions, head_size_of
from worker.models.mamba_hybrid import (
    ATTENTION,
    HybridAttention,
    HybridForCausalLM,
    HybridLayerSpec,
    HybridModel,
    build_layers,
    build_mamba,
    time_step_limit,
)


def mamba_sizes(hf_config: PretrainedConfig) -> dict[str, object]:
    """MambaConfig sizes from Bamba/Granite-style `mamba_*` keys."""
    return {
        "hidden_size": hf_config.hidden_size,
        "num_heads": hf_config.mamba_n_heads,
        "head_dim": hf_config.mamba_d_head,
        "num_groups": hf_config.mamba_n_groups,
        "state_size": hf_config.mamba_d_state,
        "conv_width": hf_config.mamba_d_conv,
        "chunk_size": hf_config.mamba_chunk_size,
        "norm_eps": hf_config.rms_norm_eps,
        "conv_bias": bool(hf_config.mamba_conv_bias),
        "proj_bias": bool(hf_config.mamba_proj_bias),
        "dt_limit": time_step_limit(hf_config),
    }


class BambaForCausalLM(HybridForCausalLM):
    """transformers' `BambaForCausalLM`."""

    renames = (("model.final_layernorm.", "model.norm."),)

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(
            hidden_act=hf_config.hidden_act,
            attn_scale=head_size_of(hf_config) ** -0.5,
            qkv_bias=bool(hf_config.attention_bias),
            o_bias=bool(hf_config.attention_bias),
            mlp_bias=bool(hf_config.mlp_bias),
        )

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        attn = set(hf_config.attn_layer_indices or ())
        specs = [
            HybridLayerSpec.state_or_attention(
                i not in attn, "mamba", "input_layernorm", "feed_forward", "pre_ff_layernorm"
            )
            for i in range(hf_config.num_hidden_layers)
        ]
        eps = hf_config.rms_norm_eps

        def modules(idx: int, spec: HybridLayerSpec) -> dict[str, nn.Module]:
            mixer: nn.Module
            if spec.kind == ATTENTION:
                mixer = HybridAttention(hf_config, self.options, LayerOptions(), idx, parallel)
            else:
                mixer = build_mamba(hf_config, idx, mamba_sizes(hf_config), parallel)
            return {
                "input_layernorm": RMSNorm(hf_config.hidden_size, eps),
                spec.mixer_name: mixer,
                "pre_ff_layernorm": RMSNorm(hf_config.hidden_size, eps),
                "feed_forward": DecoderMLP(hf_config, self.options, parallel),
            }

        rotary = RotaryEmbedding(head_size_of(hf_config), rope_parameters(hf_config))
        layers = build_layers(specs, modules)
        return HybridModel(hf_config, layers, parallel, rotary, eps)

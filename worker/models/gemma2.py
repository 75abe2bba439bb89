"""Gemma 2: alternating sliding/global layers, logit softcaps, sandwich norms, scaled embeddings.

Attention scores are scaled by `query_pre_attn_scalar ** -0.5` (not head_dim) and softcapped by
`attn_logit_softcapping`; the final logits are softcapped by `final_logit_softcapping`.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from worker.models.decoder import (
    DecoderForCausalLM,
    DecoderOptions,
    LayerOptions,
    window_from_layer_types,
)


def _optional_float(value: float | None) -> float | None:
    return float(value) if value is not None else None


class Gemma2ForCausalLM(DecoderForCausalLM):
    """Gemma 2 causal LM."""

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        hidden_act = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
        return DecoderOptions(
            hidden_act=hidden_act,
            attn_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            gemma_norm=True,
            sandwich_norm=True,
            attn_softcap=_optional_float(getattr(hf_config, "attn_logit_softcapping", None)),
            final_softcap=_optional_float(getattr(hf_config, "final_logit_softcapping", None)),
            embed_scale=float(hf_config.hidden_size) ** 0.5,
        )

    def layer_options(self, hf_config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        return LayerOptions(sliding_window=window_from_layer_types(hf_config, layer_idx))

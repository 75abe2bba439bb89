"""Llama-style models (Llama 2/3, SmolLM2, ...) and Mistral, which adds a window to every layer."""

from __future__ import annotations

from transformers import PretrainedConfig

from worker.models.decoder import DecoderForCausalLM, DecoderOptions, LayerOptions, head_size_of


class LlamaForCausalLM(DecoderForCausalLM):
    """Pre-norm decoder with SwiGLU MLP, rope and grouped-query attention."""

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(
            hidden_act=hf_config.hidden_act,
            attn_scale=head_size_of(hf_config) ** -0.5,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with sliding-window attention on every layer (when `sliding_window` is set)."""

    def layer_options(self, hf_config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        window = getattr(hf_config, "sliding_window", None)
        return LayerOptions(sliding_window=int(window) if window is not None else None)

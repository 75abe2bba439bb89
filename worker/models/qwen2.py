"""Qwen2: Llama with biased q/k/v projections and optional sliding windows on upper layers.

The windows follow the config's `layer_types`, which transformers derives from
`use_sliding_window`, `sliding_window` and `max_window_layers` when the file does not list them.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from worker.models.decoder import DecoderOptions, LayerOptions, window_from_layer_types
from worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM."""

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        options = super().decoder_options(hf_config)
        return replace(options, qkv_bias=True, o_bias=False, mlp_bias=False)

    def layer_options(self, hf_config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        if not getattr(hf_config, "use_sliding_window", False):
            return LayerOptions()
        return LayerOptions(sliding_window=window_from_layer_types(hf_config, layer_idx))

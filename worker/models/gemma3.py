"""Gemma 3 (text): Gemma 2's layout plus q/k norms and one rope theta per layer type.

Sliding layers use the local theta (`rope_parameters["sliding_attention"]`, formerly
`rope_local_base_freq`), global layers the global one. As in transformers, the attention
softcap is not applied; the final-logit softcap is.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from worker.layers.rotary import rope_parameters
from worker.models.decoder import DecoderOptions, LayerOptions, window_from_layer_types
from worker.models.gemma2 import Gemma2ForCausalLM

_LAYER_TYPES = ("sliding_attention", "full_attention")


def _layer_types(hf_config: PretrainedConfig) -> list[str]:
    return list(hf_config.layer_types)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text-only causal LM."""

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(
                "Gemma 3 with bidirectional attention is an encoder; it cannot be served"
            )
        options = super().decoder_options(hf_config)
        return replace(options, qk_norm=True, attn_softcap=None)

    def layer_options(self, hf_config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        return LayerOptions(
            sliding_window=window_from_layer_types(hf_config, layer_idx),
            rope=_layer_types(hf_config)[layer_idx],
        )

    def rope_tables(self, hf_config: PretrainedConfig) -> dict[str, dict[str, object]]:
        tables = {}
        params = getattr(hf_config, "rope_parameters", None) or {}
        for layer_type in sorted(set(_layer_types(hf_config))):
            if layer_type not in _LAYER_TYPES:
                raise ValueError(f"Gemma 3 layer type {layer_type!r} is not supported")
            if layer_type in params:
                tables[layer_type] = rope_parameters(hf_config, layer_type)
            elif layer_type == "sliding_attention":
                theta = getattr(hf_config, "rope_local_base_freq", 10000.0)
                tables[layer_type] = {"rope_type": "default", "rope_theta": theta}
            else:
                tables[layer_type] = rope_parameters(hf_config)
        return tables

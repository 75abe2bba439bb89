"""A tiny random Gemma 3n text model (the last 3 of 6 layers read earlier layers' KV: cross-layer
KV sharing, with sliding and full attention alternating), saved to a folder."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers.tiny_models import random_eager_model

COMMON: dict[str, object] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
"""The small text-model sizes the Gemma 3n and Llama 4 parity configs share."""
GEMMA3N: dict[str, object] = {
    **COMMON,
    "vocab_size_per_layer_input": 128,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "sliding_window": 6,
    "num_kv_shared_layers": 3,
    "hidden_size_per_layer_input": 8,
    "laurel_rank": 4,
    "altup_num_inputs": 3,
    "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
}


def save_tiny_gemma3n(path: Path, **overrides: object) -> torch.nn.Module:
    """Build the tiny Gemma 3n (with `overrides`), save it to `path`, return the model."""
    config = transformers.Gemma3nTextConfig(**{**GEMMA3N, **overrides})
    model = random_eager_model(config, "Gemma3nForCausalLM", lambda name: "norm" in name)
    model.save_pretrained(path)
    return model

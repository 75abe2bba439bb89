"""Tiny random Mamba-2 hybrid models (Bamba, GraniteMoeHybrid, NemotronH), saved to a folder.

Shapes are chosen so that one Mamba state (fp32) fits in three attention pages of block size 4:
the hybrid KV config then uses blocks of 12 tokens, short enough for prefix hits in tests.
"""

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
    "max_position_embeddings": 256,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
MAMBA_KEYS: dict[str, object] = {
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "mamba_chunk_size": 8,
    "mamba_n_groups": 1,
}
HYBRID_FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        {**MAMBA_KEYS, "intermediate_size": 96, "num_hidden_layers": 4, "attn_layer_indices": [1]},
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        {
            **MAMBA_KEYS,
            "intermediate_size": 32,
            "shared_intermediate_size": 48,
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "position_embedding_type": "rope",
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 3.0,
        },
    ),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        {
            "head_dim": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "ssm_state_size": 8,
            "n_groups": 1,
            "conv_kernel": 4,
            "chunk_size": 8,
            "intermediate_size": 96,
            "layers_block_type": ["linear_attention", "full_attention", "mlp", "linear_attention"],
        },
    ),
}


def build_tiny_hybrid(family: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random fp32 eager model of `family` (weights spread wider than transformers' init)."""
    config_name, model_name, extra = HYBRID_FAMILIES[family]
    kwargs = {**COMMON, **extra, **overrides}
    if family == "granitemoehybrid":  # transformers names the layer kinds differently here
        kinds = {"mamba": "linear_attention", "attention": "full_attention"}
        kwargs["layer_types"] = [kinds.get(k, k) for k in kwargs["layer_types"]]  # type: ignore[union-attr]
    config = getattr(transformers, config_name)(**kwargs)
    return random_eager_model(
        config,
        model_name,
        lambda name: "norm" in name or name.endswith(("D", "dt_bias", "A_log")),
        seed,
    )


def save_tiny_hybrid(
    family: str, path: Path, seed: int = 0, **overrides: object
) -> torch.nn.Module:
    """Build a tiny hybrid model, save it to `path`, return the transformers model."""
    model = build_tiny_hybrid(family, seed, **overrides)
    model.save_pretrained(path)
    return model

"""Tiny random linear-attention hybrids (Qwen3-Next, Qwen3.5 dense and MoE, LFM2), saved to a
folder.

Shapes: one gated DeltaNet state (fp32: conv [64, 3] + recurrent [4, 8, 8]) fits in two
attention pages of block size 4, so the hybrid blocks are 8 tokens; an LFM2 conv state fits in
one page (blocks of 4). Three DeltaNet layers, then attention (the real models' pattern).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers import tiny_hybrid
from tests.helpers.tiny_models import random_eager_model

COMMON: dict[str, object] = {**tiny_hybrid.COMMON, "tie_word_embeddings": False}
DELTA_NET: dict[str, object] = {
    "head_dim": 16,
    "num_hidden_layers": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 96,
}
MOE: dict[str, object] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
LINEAR_FAMILIES: dict[str, tuple[str, str, dict[str, object]]] = {
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {**DELTA_NET, **MOE, "mlp_only_layers": [0], "norm_topk_prob": True},
    ),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", DELTA_NET),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {**DELTA_NET, **MOE}),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "conv_L_cache": 3,
            "intermediate_size": 96,
        },
    ),
}


TINY_VISION: dict[str, object] = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "num_position_embeddings": 16,
}


def save_tiny_qwen3_5_multimodal(path: Path, seed: int = 0) -> torch.nn.Module:
    """A tiny `Qwen3_5ForConditionalGeneration` (vision encoder included), saved to `path`."""
    text = {**COMMON, **DELTA_NET}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=TINY_VISION)
    model = random_eager_model(config, "Qwen3_5ForConditionalGeneration", _is_offset, seed)
    model.save_pretrained(path)
    return model


def _is_offset(name: str) -> bool:
    return "norm" in name or name.endswith(("dt_bias", "A_log"))


def build_tiny_linear_hybrid(family: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random fp32 eager model of `family`."""
    config_name, model_name, extra = LINEAR_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    return random_eager_model(config, model_name, _is_offset, seed)


def save_tiny_linear_hybrid(
    family: str, path: Path, seed: int = 0, **overrides: object
) -> torch.nn.Module:
    """Build a tiny model of `family`, save it to `path`, return the transformers model."""
    model = build_tiny_linear_hybrid(family, seed, **overrides)
    model.save_pretrained(path)
    return model

"""Tiny random Gemma 4 text and gpt-oss models (their configs and one builder), saved to a folder.

The tiny Gemma 4 has global layers with a larger head (64 vs 16), K = V, two KV-sharing layers
and per-layer inputs; gpt-oss has sinks, MoE and YaRN with a short original context.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers.tiny_models import random_eager_model

COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "sliding_window": 6,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
GEMMA4 = {
    **COMMON,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "global_head_dim": 64,
    "num_key_value_heads": 1,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 256,
    "final_logit_softcapping": 5.0,
    "attention_bias": True,  # False in released checkpoints; True exercises every projection
}
GEMMA4_MOE = {
    **GEMMA4,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
}
# The large checkpoints' shape: no per-layer inputs, no KV sharing, one global layer per six.
GEMMA4_PLAIN = {
    **GEMMA4,
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "final_logit_softcapping": None,
}
GPT_OSS = {
    **COMMON,
    "intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "rope_parameters": {  # YaRN with a short original context, so the ramp matters
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
}


def save_gemma4_or_gpt_oss(
    config_cls: str, model_cls: str, kwargs: dict[str, object], path: Path
) -> torch.nn.Module:
    """transformers' `model_cls` of `config_cls(**kwargs)`, random, saved to `path` (fp32)."""
    config = getattr(transformers, config_cls)(**kwargs)
    model = random_eager_model(
        config,
        model_cls,
        lambda name: "norm" in name or "scale" in name,
        # sinks spread wider so that they change the attention weights visibly
        spread=lambda name: 0.5 if name.endswith("sinks") else 0.1,
    )
    for name, buffer in model.named_buffers():
        if name.endswith("layer_scalar"):
            buffer.fill_(0.9)
    model.save_pretrained(path)
    return model

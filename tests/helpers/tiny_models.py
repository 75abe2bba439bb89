"""Tiny random transformers models, built in-process and saved to a folder (no downloads).

Weights are re-drawn with a larger spread than transformers' init (and norms/biases perturbed)
so that softcaps, norm weights, biases and windows all change the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedConfig, PreTrainedModel

from worker.config import ModelConfig, ParallelConfig
from worker.models.registry import get_model_class
from worker.weights import iterate_weights

BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}
WINDOW = 6

FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}),
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": False,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "tie_word_embeddings": False,
            "final_logit_softcapping": 3.0,
            "layer_types": [
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        },
    ),
}
# Families whose chunked local layers need the runner's chunk transform (not the paged driver's
# plain attention): built here like the others, but not in FAMILIES.
CHUNKED_FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "llama4": (  # chunked local attention (chunks of 8) with every second layer global and NoPE
        "Llama4TextConfig",
        {
            "head_dim": 16,
            "intermediate_size": 32,
            "intermediate_size_mlp": 96,
            "attention_chunk_size": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "interleave_moe_layer_step": 2,
            "no_rope_layer_interval": 2,
            "floor_scale": 4,
        },
    ),
}
MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Gemma2Config": "Gemma2ForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
    "Llama4TextConfig": "Llama4ForCausalLM",
}


def random_eager_model(
    config: PreTrainedConfig,
    model_class: str,
    is_offset: Callable[[str], bool],
    seed: int = 0,
    spread: Callable[[str], float] = lambda name: 0.1,
) -> PreTrainedModel:
    """transformers' `model_class` (eager attention, fp32) with its weights re-drawn: a parameter
    named so that `is_offset` holds (norm weights, biases, ...) is perturbed by N(0, 0.1) around
    its init, every other one drawn from N(0, spread(name))."""
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)._from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_offset(name):
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.normal_(0.0, spread(name))
    return model.eval()


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    """transformers' greedy continuation of `prompt`: `num_new` token IDs."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def load_our_model(path: Path) -> torch.nn.Module:
    """Our model of the checkpoint at `path`, every parameter loaded (asserted)."""
    model_config = ModelConfig.from_pretrained(path, dtype="float32")
    model = get_model_class(model_config.architecture)(model_config, ParallelConfig())
    loaded = model.load_weights(iterate_weights(path))
    assert loaded == {name for name, _ in model.named_parameters()}
    return model.eval()


def build_tiny_model(family: str, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """A random eager-attention model of `family` in fp32."""
    config_name, extra = {**FAMILIES, **CHUNKED_FAMILIES}[family]
    config = getattr(transformers, config_name)(**{**BASE, **extra, **overrides})
    return random_eager_model(
        config,
        MODEL_CLASSES[config_name],
        lambda name: "norm" in name or name.endswith("bias"),
        seed,
    )


def save_tiny_model(family: str, path: Path, seed: int = 0, **overrides: object) -> PreTrainedModel:
    """Build a tiny model, save it (config.json + model.safetensors) to `path`, return it."""
    model = build_tiny_model(family, seed, **overrides)
    model.save_pretrained(path)
    return model

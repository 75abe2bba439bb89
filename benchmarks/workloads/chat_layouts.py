"""Page layouts of the hybrid models the multi-turn chat benchmark replays, and an attention-only
reference, each as the per-layer specs the workers would report (one rank, bf16, block 16).

Granite-4.0-H-Small and Qwen3.5-27B come from the capacity workloads; Nemotron-H-8B and LFM2-1.2B
are defined here from their published configs (layers without a cache, MLP-only ones, are left
out: they hold no KV).
"""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.workloads.hybrid_capacity import (
    GRANITE_4_H_SMALL,
    HybridShape,
    attention_spec,
    full_attention_specs,
    hybrid_layer_specs,
)
from benchmarks.workloads.linear_attention_capacity import QWEN3_5_27B, linear_hybrid_specs
from scheduler.kv_cache.linear_state_spec import ShortConvShape
from scheduler.kv_cache.spec import KVCacheSpec, MambaCacheMode

NEMOTRON_H_8B = HybridShape(
    num_layers=28,
    attention_layers=(4, 11, 18, 25),
    num_kv_heads=8,
    head_size=128,
    mamba_heads=128,
    mamba_head_dim=64,
    mamba_groups=8,
    mamba_state=128,
    conv_width=4,
)
"""Nemotron-H-8B's cached layers: 24 Mamba-2 (128 heads of 64, 8 groups, state 128) and 4
attention layers (8 KV heads of 128)."""

LFM2_ATTENTION_LAYERS = (2, 5, 8, 10, 12, 14)
LFM2_CONV = ShortConvShape(channels=2048, conv_width=3)
"""LFM2-1.2B: 16 layers, 10 short convolutions over 2,048 channels (kernel 3) and 6 attention
layers (8 KV heads of 64)."""


def lfm2_specs(block_size: int, mode: MambaCacheMode) -> dict[str, KVCacheSpec]:
    attention = attention_spec(8, 64, 2, block_size)
    conv = LFM2_CONV.spec(block_size, 2, mode)
    return {
        f"model.layers.{i}": attention if i in LFM2_ATTENTION_LAYERS else conv for i in range(16)
    }


CHAT_LAYOUTS: dict[str, Callable[[int, MambaCacheMode], dict[str, KVCacheSpec]]] = {
    "granite-4.0-h-small": lambda block, mode: hybrid_layer_specs(GRANITE_4_H_SMALL, block, mode),
    "nemotron-h-8b": lambda block, mode: hybrid_layer_specs(NEMOTRON_H_8B, block, mode),
    "qwen3.5-27b": lambda block, mode: linear_hybrid_specs(QWEN3_5_27B, block, mode),
    "lfm2-1.2b": lfm2_specs,
    "attention-only": lambda block, _: full_attention_specs(GRANITE_4_H_SMALL, block),
}
"""Name -> specs(block_size, mamba_cache_mode); the last is the reference without state."""

"""Layer specs of linear-attention hybrids (gated DeltaNet + gated full attention) for capacity
figures: the Qwen3.5-27B and Qwen3-Next-80B-A3B layouts, one rank, bf16.

Both put one full-attention layer after every three gated DeltaNet layers. A DeltaNet layer's
state per request is constant (conv [2*Hk*Dk + Hv*Dv, 3] + recurrent [Hv, Dk, Dv], about
1 MiB in bf16 for 32 value heads of 128 x 128), so only the attention quarter grows with length.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.workloads.hybrid_capacity import attention_spec
from scheduler.kv_cache.linear_state_spec import GatedDeltaNetShape
from scheduler.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaCacheMode


@dataclass(frozen=True)
class LinearHybridShape:
    """Layer layout and sizes of a gated DeltaNet / attention hybrid (whole model)."""

    num_layers: int
    full_attention_interval: int
    """Layer i is full attention when (i + 1) % interval == 0."""
    num_kv_heads: int
    head_size: int
    delta_net: GatedDeltaNetShape
    dtype_bytes: int = 2
    """Bytes per attention KV element (2: bf16; 1: an fp8 KV cache)."""
    state_dtype_bytes: int = 2
    """Bytes per conv and recurrent state element (`mamba_ssm_cache_dtype`)."""

    def is_attention(self, layer_idx: int) -> bool:
        return (layer_idx + 1) % self.full_attention_interval == 0


QWEN3_5_27B = LinearHybridShape(
    num_layers=64,
    full_attention_interval=4,
    num_kv_heads=4,
    head_size=256,
    delta_net=GatedDeltaNetShape(
        num_k_heads=16, num_v_heads=48, head_k_dim=128, head_v_dim=128, conv_width=4
    ),
)
"""Qwen3.5-27B-shaped: 64 layers (48 DeltaNet with 16 key / 48 value heads of 128, 16
attention with 4 KV heads of 256)."""

QWEN3_NEXT_80B_A3B = LinearHybridShape(
    num_layers=48,
    full_attention_interval=4,
    num_kv_heads=2,
    head_size=256,
    delta_net=GatedDeltaNetShape(
        num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_width=4
    ),
)
"""Qwen3-Next-80B-A3B-shaped: 48 layers (36 DeltaNet with 16 key / 32 value heads of 128, 12
attention with 2 KV heads of 256)."""


def _attention(shape: LinearHybridShape, block_size: int, tp_size: int = 1) -> FullAttentionSpec:
    return attention_spec(
        shape.num_kv_heads, shape.head_size, shape.dtype_bytes, block_size, tp_size
    )


def linear_hybrid_specs(
    shape: LinearHybridShape,
    block_size: int,
    mode: MambaCacheMode = MambaCacheMode.ALIGN,
    tp_size: int = 1,
) -> dict[str, KVCacheSpec]:
    """Specs of every layer of `shape` in model order, for one of `tp_size` ranks."""
    attention = _attention(shape, block_size, tp_size)
    state = shape.delta_net.per_rank(tp_size).spec(block_size, shape.state_dtype_bytes, mode)
    return {
        f"model.layers.{i}": attention if shape.is_attention(i) else state
        for i in range(shape.num_layers)
    }


def all_attention_specs(shape: LinearHybridShape, block_size: int) -> dict[str, KVCacheSpec]:
    """The same depth with every layer full attention (the baseline without state layers)."""
    attention = _attention(shape, block_size)
    return {f"model.layers.{i}": attention for i in range(shape.num_layers)}

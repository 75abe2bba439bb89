"""How many concurrent requests of a given length fit in a KV memory budget (pure arithmetic).

Used by the Mamba capacity benchmark and its test: layer specs of a model -> the hybrid KV cache
config (page-size unification, groups, block count) -> worst-case blocks per request -> requests.
A Mamba-2 layer's state is `conv [conv_dim, width - 1]` plus `SSM [heads, head_dim, state]`,
constant in the sequence length, so a hybrid model's memory per request is dominated by its few
attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.kv_cache.builder import build_kv_cache_config, max_concurrency, request_blocks
from scheduler.kv_cache.spec import FullAttentionSpec, KVCacheSpec, MambaCacheMode, MambaSpec


@dataclass(frozen=True)
class HybridShape:
    """Layer layout and sizes of a Mamba-2 / attention hybrid (whole model, one rank)."""

    num_layers: int
    attention_layers: tuple[int, ...]
    num_kv_heads: int
    head_size: int
    mamba_heads: int
    mamba_head_dim: int
    mamba_groups: int
    mamba_state: int
    conv_width: int
    dtype_bytes: int = 2
    """Bytes per attention KV element (2: bf16; 1: an fp8 KV cache)."""
    state_dtype_bytes: int = 2
    """Bytes per conv and SSM state element (`mamba_ssm_cache_dtype`)."""


GRANITE_4_H_SMALL = HybridShape(
    num_layers=40,
    attention_layers=(5, 15, 25, 35),
    num_kv_heads=8,
    head_size=128,
    mamba_heads=128,
    mamba_head_dim=64,
    mamba_groups=1,
    mamba_state=128,
    conv_width=4,
)
"""Granite-4.0-H-Small's layout (hidden 4096: 4 attention and 36 Mamba-2 layers), bf16."""


def attention_spec(
    num_kv_heads: int, head_size: int, dtype_bytes: int, block_size: int, tp_size: int = 1
) -> FullAttentionSpec:
    """A full-attention layer's spec on one of `tp_size` ranks (at least one KV head each)."""
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=max(num_kv_heads // tp_size, 1),
        head_size=head_size,
        dtype_bytes=dtype_bytes,
    )


def hybrid_layer_specs(
    shape: HybridShape, block_size: int, mode: MambaCacheMode = MambaCacheMode.ALIGN
) -> dict[str, KVCacheSpec]:
    """Specs of every layer of `shape` in model order."""
    attention = attention_spec(shape.num_kv_heads, shape.head_size, shape.dtype_bytes, block_size)
    inner = shape.mamba_heads * shape.mamba_head_dim
    conv_dim = inner + 2 * shape.mamba_groups * shape.mamba_state
    state = MambaSpec(
        block_size=block_size,
        shapes=(
            (conv_dim, shape.conv_width - 1),
            (shape.mamba_heads, shape.mamba_head_dim, shape.mamba_state),
        ),
        dtype_bytes=(shape.state_dtype_bytes, shape.state_dtype_bytes),
        mamba_cache_mode=mode,
    )
    return {
        f"model.layers.{i}": attention if i in shape.attention_layers else state
        for i in range(shape.num_layers)
    }


def full_attention_specs(shape: HybridShape, block_size: int) -> dict[str, KVCacheSpec]:
    """The same model with every layer full attention (the baseline)."""
    attention = attention_spec(shape.num_kv_heads, shape.head_size, shape.dtype_bytes, block_size)
    return {f"model.layers.{i}": attention for i in range(shape.num_layers)}


@dataclass(frozen=True)
class Capacity:
    """The capacity figure of one model in one budget."""

    block_size: int
    """Block size of the groups after page-size unification (tokens)."""
    num_blocks: int
    bytes_per_request: int
    """Worst-case KV bytes one request of the given length holds."""
    concurrent_requests: float


def capacity(specs: dict[str, KVCacheSpec], memory_bytes: int, seq_len: int) -> Capacity:
    """Concurrent worst-case requests of `seq_len` tokens in `memory_bytes` of KV memory."""
    config = build_kv_cache_config(specs, memory_bytes, max_model_len=seq_len)
    block_cost = sum(tensor.size_bytes for tensor in config.tensors) // config.num_blocks
    return Capacity(
        block_size=max(config.block_sizes),
        num_blocks=config.num_blocks,
        bytes_per_request=request_blocks(config, seq_len) * block_cost,
        concurrent_requests=max_concurrency(config, seq_len),
    )

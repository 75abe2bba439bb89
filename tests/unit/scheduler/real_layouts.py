"""Layer layouts shaped like released hybrid models (bf16, one rank), for capacity tables.

Public config shapes: layer count, which layers are windowed / chunked / global / Mamba, KV heads
and head size. Weights are never involved.
"""

from __future__ import annotations

from benchmarks.workloads.hybrid_capacity import (
    GRANITE_4_H_SMALL,
    full_attention_specs,
    hybrid_layer_specs,
)
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

BLOCK = 16


def _full(heads: int, head: int, *, keys_from_values: bool = False) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=heads,
        head_size=head,
        dtype_bytes=2,
        keys_from_values=keys_from_values,
    )


def _window(heads: int, head: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=heads, head_size=head, dtype_bytes=2, sliding_window=window
    )


def interleaved(
    num_layers: int, period: int, local: KVCacheSpec, global_: KVCacheSpec
) -> dict[str, KVCacheSpec]:
    """Layer i is global when (i + 1) % period == 0, else local."""
    return {
        f"model.layers.{i}.attn": global_ if (i + 1) % period == 0 else local
        for i in range(num_layers)
    }


def _llama4_scout() -> dict[str, KVCacheSpec]:
    chunked = ChunkedLocalAttentionSpec(
        block_size=BLOCK, num_kv_heads=8, head_size=128, dtype_bytes=2, attention_chunk_size=8192
    )
    return interleaved(48, 4, chunked, _full(8, 128))


REAL_LAYOUTS: dict[str, dict[str, KVCacheSpec]] = {
    "gemma-3-27b": interleaved(62, 6, _window(16, 128, 1024), _full(16, 128)),
    "gemma-3n-e4b (KV owners)": interleaved(20, 5, _window(2, 256, 512), _full(2, 256)),
    "gemma-4-31b": interleaved(60, 6, _window(16, 256, 1024), _full(4, 512, keys_from_values=True)),
    "gpt-oss-120b": interleaved(36, 2, _window(8, 64, 128), _full(8, 64)),
    "llama-4-scout": _llama4_scout(),
    "granite-4.0-h-small": hybrid_layer_specs(GRANITE_4_H_SMALL, BLOCK),
}
"""Model -> per-layer specs in model order."""

HYBRID_OFF: dict[str, dict[str, KVCacheSpec]] = {
    "granite-4.0-h-small": full_attention_specs(GRANITE_4_H_SMALL, BLOCK),
}
"""The hybrid-off baseline where folding is impossible (Mamba): every layer full attention.
Other models' baseline folds windowed and chunked layers into full attention."""

"""Attention-only hybrid layouts (sliding-window and full layers) of published configs, one rank:
gpt-oss-20b and Gemma-3-27B."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from scheduler.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


class AttentionLayers(NamedTuple):
    """Sliding and full attention layers of one shape; `is_full(i)` picks the full ones."""

    num_layers: int
    is_full: Callable[[int], bool]
    num_kv_heads: int
    head_size: int
    sliding_window: int

    def specs(self, block_size: int, kv_bytes: int = 2) -> dict[str, KVCacheSpec]:
        """Layer specs in model order, `kv_bytes`-byte KV elements."""
        shape = {
            "block_size": block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype_bytes": kv_bytes,
        }
        full = FullAttentionSpec(**shape)  # type: ignore[arg-type]
        sliding = SlidingWindowSpec(**shape, sliding_window=self.sliding_window)  # type: ignore[arg-type]
        layers = range(self.num_layers)
        return {f"model.layers.{i}": full if self.is_full(i) else sliding for i in layers}


GPT_OSS_20B = AttentionLayers(24, lambda i: i % 2 == 1, 8, 64, 128)
"""24 layers alternating sliding (window 128; layer 0 sliding) and full, 8 KV heads x 64."""
GEMMA_3_27B = AttentionLayers(62, lambda i: (i + 1) % 6 == 0, 16, 128, 1024)
"""62 layers, five sliding (window 1024) to one full, 16 KV heads x 128."""

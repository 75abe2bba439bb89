"""Spec and plan builders shared by the KV cache config tests (S24 naming: layers l1, l2, ...)."""

from __future__ import annotations

from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)

KIB = 1024
GIB = 1 << 30
PAGE = 16 * KIB
"""S24 layer page: block 16, 2 KV heads, head 64, fp32."""
WINDOW = 128


def full(head: int = 64, bs: int = 16, heads: int = 2, dtype: int = 4) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype_bytes=dtype)


def sw(head: int = 64, bs: int = 16, window: int = WINDOW) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs, num_kv_heads=2, head_size=head, dtype_bytes=4, sliding_window=window
    )


def cla(head: int = 64, bs: int = 16, chunk: int = 64) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=bs, num_kv_heads=2, head_size=head, dtype_bytes=4, attention_chunk_size=chunk
    )


def mamba(shapes: tuple[tuple[int, ...], ...], bs: int = 16, **kw: object) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=shapes, dtype_bytes=(4,) * len(shapes), **kw)


def layers(*kinds: str) -> dict[str, object]:
    """`layers("F", "S")` -> {"l1": full(), "l2": sw()} (S24 naming)."""
    make = {"F": full, "S": sw}
    return {f"l{i + 1}": make[kind]() for i, kind in enumerate(kinds)}


def group_names(config: KVCacheConfig) -> list[tuple[str, ...]]:
    return [group.layer_names for group in config.groups]


def tensor_names(config: KVCacheConfig) -> list[tuple[str, ...]]:
    return [tensor.shared_by for tensor in config.tensors]


def tensor_pages(config: KVCacheConfig) -> list[int]:
    return [tensor.size_bytes // PAGE for tensor in config.tensors]


def names(first: int, last: int) -> tuple[str, ...]:
    return tuple(f"l{i}" for i in range(first, last + 1))

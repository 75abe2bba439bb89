"""One builder of KV cache specs by kind name (the specs' own `kind`), for tools that describe
groups without a model: the trace replay (`scheduler.replay`), the KV cache core tests and the
benchmarks.

    make_spec("full_attention", 16)                         full attention, 16-token blocks
    make_spec("sliding_window", 16, 1024)                   window of 1024 tokens
    make_spec("chunked_local_attention", 16, 8192)          chunks of 8192 tokens
    make_spec("mamba", 16, mamba_cache_mode=MambaCacheMode.ALIGN)
    make_spec("gated_delta_net", 16)                        also "short_conv": Mamba-managed states

The default shapes are dummies (one KV head of size 1, 4-byte elements; a one-element Mamba
state) for tools where page sizes do not matter; pass `shape` for realistic pages.
"""

from __future__ import annotations

from typing import NamedTuple

from scheduler.kv_cache.linear_state_spec import GatedDeltaNetSpec, ShortConvSpec
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)

STATE_SPECS: dict[str, type[MambaSpec]] = {
    "mamba": MambaSpec,
    "gated_delta_net": GatedDeltaNetSpec,
    "short_conv": ShortConvSpec,
}
"""Recurrent-state kinds (one `MambaShape` each), all managed by the Mamba manager."""
SPEC_KINDS = ("full_attention", "sliding_window", "chunked_local_attention", *STATE_SPECS)
"""The kind names `make_spec` takes: `make_spec(kind, ...).kind == kind`."""


class AttentionShape(NamedTuple):
    """KV shape of an attention layer."""

    num_kv_heads: int = 1
    head_size: int = 1
    dtype_bytes: int = 4


class MambaShape(NamedTuple):
    """State shapes (conv, SSM, ...) of a Mamba layer and the bytes of their elements."""

    shapes: tuple[tuple[int, ...], ...] = ((1,),)
    dtype_bytes: tuple[int, ...] = (4,)


def make_spec(
    kind: str,
    block_size: int,
    size: int | None = None,
    *,
    shape: AttentionShape | MambaShape | None = None,
    mamba_cache_mode: MambaCacheMode = MambaCacheMode.ALL,
) -> KVCacheSpec:
    """The spec of one layer of `kind` (one of `SPEC_KINDS`); `size` is the window of
    "sliding_window" and the chunk of "chunked_local_attention". ValueError on an unknown kind,
    a missing size or a shape of the wrong kind."""
    if kind in STATE_SPECS:
        state = shape if shape is not None else MambaShape()
        if not isinstance(state, MambaShape):
            raise ValueError(f"a {kind} spec needs a MambaShape, got {state!r}")
        return STATE_SPECS[kind](
            block_size=block_size,
            shapes=state.shapes,
            dtype_bytes=state.dtype_bytes,
            mamba_cache_mode=mamba_cache_mode,
        )
    attention = shape if shape is not None else AttentionShape()
    if not isinstance(attention, AttentionShape):
        raise ValueError(f"a {kind} spec needs an AttentionShape, got {attention!r}")
    heads, head_size, dtype_bytes = attention
    if kind == "full_attention":
        return FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype_bytes=dtype_bytes
        )
    if kind not in SPEC_KINDS:
        raise ValueError(f"unknown group type {kind!r} (one of {', '.join(SPEC_KINDS)})")
    if size is None:
        raise ValueError(f"a {kind} spec needs its window or chunk size")
    if kind == "sliding_window":
        return SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=head_size,
            dtype_bytes=dtype_bytes,
            sliding_window=size,
        )
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype_bytes=dtype_bytes,
        attention_chunk_size=size,
    )


def one_layer_groups_config(num_blocks: int, specs: list[KVCacheSpec]) -> KVCacheConfig:
    """A config (no tensor plan) with one group of one layer (`layer{i}`) per spec."""
    groups = tuple(KVCacheGroupSpec((f"layer{index}",), spec) for index, spec in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=())

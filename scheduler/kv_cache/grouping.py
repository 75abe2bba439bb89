"""Split the layers of a model into KV cache groups (used by `build_kv_cache_config`).

Decision tree: no layers -> no groups; mergeable specs -> one group; one type with several page
sizes -> one `UniformTypeKVCacheSpecs` group; otherwise (hybrid) unify page sizes, then cut the
layers of each spec into groups of equal size. KV-sharing layers own no memory: they are left
out here and join their target's group afterwards (`sharing.py`). All functions take
`{layer: spec}` in model order.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import replace

from scheduler.kv_cache.spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    merge_specs,
)

logger = logging.getLogger(__name__)

LayerSpecs = dict[str, KVCacheSpec]


def fold_to_full_attention(specs: LayerSpecs) -> LayerSpecs:
    """Rewrite sliding-window and chunked-local specs as full attention remembering the window
    or chunk (memory for every token; kernels still attend inside the window or chunk)."""
    folded: LayerSpecs = {}
    for name, spec in specs.items():
        if isinstance(spec, SlidingWindowSpec):
            folded[name] = _as_full(spec, sliding_window=spec.sliding_window)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            folded[name] = _as_full(spec, attention_chunk_size=spec.attention_chunk_size)
        else:
            folded[name] = spec
    return folded


def _as_full(
    spec: AttentionSpec,
    *,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=spec.block_size,
        drafter=spec.drafter,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype_bytes=spec.dtype_bytes,
        keys_from_values=spec.keys_from_values,
        sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size,
    )


def group_layers(specs: LayerSpecs, *, disable_hybrid: bool) -> tuple[KVCacheGroupSpec, ...]:
    """KV cache groups of `specs`, following the decision tree of the module docstring.

    With `disable_hybrid`, everything must end in one group (call `fold_to_full_attention`
    first); a model that still mixes types raises ValueError.
    """
    if not specs:
        return ()
    names = tuple(specs)
    merged = _try_merge(list(specs.values()))
    if merged is not None:
        return (KVCacheGroupSpec(names, merged),)
    if len({type_key(spec) for spec in specs.values()}) == 1:
        return (KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_layers(specs)),)
    if disable_hybrid:
        kinds = sorted({spec.kind for spec in specs.values()})
        raise ValueError(
            f"the hybrid KV cache manager is disabled, but the layers cannot share one group "
            f"(spec kinds {kinds}, or several windows / chunk sizes / block sizes); enable the "
            "hybrid manager for this model"
        )
    return split_into_groups(unify_page_sizes(specs))


def _try_merge(specs: list[KVCacheSpec]) -> KVCacheSpec | None:
    try:
        return merge_specs(specs)
    except ValueError:
        return None


def type_key(spec: KVCacheSpec) -> Hashable:
    """What must be equal for layers to share one group despite different page sizes: the
    class, the block size and what the manager reads (window, chunk, Mamba mode). Full attention
    ignores a remembered window or chunk: its manager keeps every token anyway. A drafter's
    layers never share a group with the target's."""
    if isinstance(spec, SlidingWindowSpec):
        return (SlidingWindowSpec, spec.block_size, spec.sliding_window, spec.drafter)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return (ChunkedLocalAttentionSpec, spec.block_size, spec.attention_chunk_size, spec.drafter)
    if isinstance(spec, MambaSpec):
        return (MambaSpec, spec.block_size, spec.mamba_cache_mode, spec.drafter)
    return (type(spec), spec.block_size, spec.drafter)


def unify_page_sizes(specs: LayerSpecs) -> LayerSpecs:
    """Give every layer the same page size by growing block sizes and padding Mamba pages.

    Rule:
    1. Attention layers: the largest attention page P must be a multiple of every other
       attention page p; those layers get block size x P/p.
    2. If a Mamba state is larger than P, every attention block size (and every Mamba block size,
       so state checkpoints stay on attention block ends) is multiplied by the smallest integer
       k with k*P >= the largest Mamba state. Block sizes stay multiples of the originals.
    3. Every Mamba page is padded (`page_size_padded`) to the final attention page; a model
       without attention pads its Mamba pages to the largest one.

    Why the attention block is raised (as vLLM does) rather than a state split over pages: a
    Mamba block-table entry must address one whole state (the manager caches, hits and frees
    states one block at a time), and groups share buffers page by page, so all pages need one
    size. Integer factors keep every block size a multiple of the configured one (one hash
    granularity) and keep state checkpoints on attention block ends. The cost is coarser
    prefix hits: a Granite-4.0-H-shaped model gets 528-token blocks (see docs/benchmarks.md).
    """
    attention = _scale_to_largest_page(
        {name: spec for name, spec in specs.items() if not isinstance(spec, MambaSpec)}
    )
    mamba = {name: spec for name, spec in specs.items() if isinstance(spec, MambaSpec)}
    page = max((spec.page_size_bytes for spec in attention.values()), default=0)
    mamba_page = max((spec.page_size_bytes for spec in mamba.values()), default=0)
    factor = cdiv(mamba_page, page) if 0 < page < mamba_page else 1
    if factor > 1:
        attention = {
            name: spec.with_block_size(spec.block_size * factor) for name, spec in attention.items()
        }
        page *= factor
        logger.info(
            "attention block sizes multiplied by %d so one page (%d bytes) holds a Mamba state "
            "(%d bytes)",
            factor,
            page,
            mamba_page,
        )
    page = max(page, mamba_page)
    unified: LayerSpecs = dict(attention)
    for name, spec in mamba.items():
        unified[name] = _pad_mamba(spec, page, factor)
    return {name: unified[name] for name in specs}


def _scale_to_largest_page(specs: LayerSpecs) -> LayerSpecs:
    largest = max((spec.page_size_bytes for spec in specs.values()), default=0)
    scaled: LayerSpecs = {}
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if largest % page:
            raise ValueError(
                f"cannot unify KV page sizes: {_describe_layers(specs, spec)} have pages of "
                f"{page} bytes, which do not divide the largest page ({largest} bytes) of "
                f"{_describe_layers(specs, _spec_with_page(specs, largest))}; hybrid groups "
                "need page sizes that are multiples of each other (change head sizes or block "
                "sizes, or disable the hybrid manager)"
            )
        scaled[name] = (
            spec if page == largest else spec.with_block_size(spec.block_size * (largest // page))
        )
    return scaled


def _spec_with_page(specs: LayerSpecs, page: int) -> KVCacheSpec:
    return next(spec for spec in specs.values() if spec.page_size_bytes == page)


def _describe_layers(specs: LayerSpecs, spec: KVCacheSpec) -> str:
    """'layers [a, b] (sliding_window, 2 KV heads x 16, block 4)': the layers of one spec."""
    names = [name for name, other in specs.items() if other == spec]
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} layers)" if len(names) > 4 else "")
    shape = ""
    if isinstance(spec, AttentionSpec):
        shape = f", {spec.num_kv_heads} KV heads x {spec.head_size}"
    return f"layers [{shown}] ({spec.kind}{shape}, block {spec.block_size})"


def _pad_mamba(spec: MambaSpec, page: int, factor: int) -> KVCacheSpec:
    padded = None if page == spec.natural_page_bytes else page
    return replace(spec, block_size=spec.block_size * factor, page_size_padded=padded)


def split_into_groups(specs: LayerSpecs) -> tuple[KVCacheGroupSpec, ...]:
    """Bucket layers by (unified) spec in first-seen order and cut buckets into equal groups.

    Group size = the smallest bucket, or the largest one when it is less than 1.25x the
    smallest (padding a few layers beats doubling the group count). A bucket of n layers gives
    cdiv(n, size) groups; group i takes the bucket's layers i, i+k, i+2k, ... (k groups), which
    keeps pipeline stages balanced.
    """
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        buckets.setdefault(spec, []).append(name)
    sizes = [len(names) for names in buckets.values()]
    smallest, largest = min(sizes), max(sizes)
    group_size = largest if 4 * largest < 5 * smallest else smallest
    groups: list[KVCacheGroupSpec] = []
    for spec, names in buckets.items():
        num_groups = cdiv(len(names), group_size)
        groups.extend(
            KVCacheGroupSpec(tuple(names[i::num_groups]), spec) for i in range(num_groups)
        )
    padding = sum(group_size - len(group.layer_names) for group in groups)
    if padding:
        logger.warning(
            "KV cache groups of %d layers need %d padding layers (memory that stays unused)",
            group_size,
            padding,
        )
    return tuple(groups)

"""Build the `KVCacheConfig` of a model: groups, tensor plan, block count, KV sharing, and the
memory math around it (does a max-length request fit, how long a request could be).

The engine calls `build_kv_cache_config` with the merged per-layer specs of all workers and the
smallest memory budget they measured; workers allocate and bind tensors from the result.

Tensor plan: buffer i backs the i-th layer of every group; one block ID is used by one group
at a time, so layers of different groups never overwrite each other's pages.

    group 0 (full): [l1, l2]     buffer 0: l1 | l3 | l4     each buffer = num_blocks pages
    group 1 (SW)  : [l3, l5]     buffer 1: l2 | l5 | l6
    group 2 (SW)  : [l4, l6]
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import NamedTuple

from scheduler.kv_cache.capacity_checks import blocks_per_group, check_request_fits, longest_request
from scheduler.kv_cache.grouping import fold_to_full_attention, group_layers
from scheduler.kv_cache.sharing import attach_sharing, validate_kv_sharing
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    UniformTypeKVCacheSpecs,
    manager_spec,
)

logger = logging.getLogger(__name__)

MIN_NUM_BLOCKS = 2
"""The null block plus one usable block."""


def build_kv_cache_config(  # noqa: PLR0913 - keyword options of the one public entry point
    layer_specs: dict[str, KVCacheSpec],
    memory_bytes: int,
    *,
    shared_kv_layers: Mapping[str, str] | None = None,
    disable_hybrid: bool = False,
    num_blocks_override: int | None = None,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> KVCacheConfig:
    """Group the layers, size the pool and plan the buffers for `memory_bytes` of KV memory.

    Args:
        layer_specs: spec of every layer, in model order (the worker's `KVCacheSpecReport`).
            A KV-sharing layer is listed with the spec it would have alone: its place in this
            order and its attention type are checked against its target's, and it is left
            out of the memory plan.
        shared_kv_layers: layer -> earlier layer whose KV it reads, validated here and only
            here (`sharing.validate_kv_sharing`). Sharing layers are appended to their target's
            group after the owning layers and listed in `KVCacheConfig.shared_kv_layers`.
        disable_hybrid: fold sliding-window / chunked-local layers into full attention so that
            the model has one group; ValueError if that is not possible.
        num_blocks_override: use this many blocks instead of what fits in `memory_bytes`.
        max_model_len: when given, `KVCapacityError` (a ValueError) unless one request of this
            length fits (`capacity_checks.check_request_fits`).
        max_num_batched_tokens: step token budget, bounds window layers' worst case; default
            `max_model_len` (a whole prompt in one step).
    """
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes}")
    sharing = validate_kv_sharing(layer_specs, shared_kv_layers or {})
    sharers = {layer for layer, _ in sharing}
    owners = {name: spec for name, spec in layer_specs.items() if name not in sharers}
    if disable_hybrid:
        owners = fold_to_full_attention(owners)
    groups = group_layers(owners, disable_hybrid=disable_hybrid)
    if not disable_hybrid and max_model_len is not None:
        limits = _Limits(memory_bytes, max_model_len, max_num_batched_tokens)
        groups = choose_grouping(groups, owners, limits)
    if not groups:
        logger.info("no layer holds KV memory: only the null block is allocated")
        return KVCacheConfig(num_blocks=1, groups=(), tensors=())
    _check_block_sizes(groups)
    buffers = _buffer_layout(groups)
    num_blocks = _num_blocks(memory_bytes, sum(page for _, page in buffers), num_blocks_override)
    tensors = tuple(KVCacheTensor(page * num_blocks, layers) for layers, page in buffers)
    config = KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=tensors)
    if max_model_len is not None:
        check_request_fits(config, max_model_len, max_num_batched_tokens)
    logger.info(
        "KV cache: %d groups (block sizes %s), %d buffers, %d blocks (%d tokens)",
        len(groups),
        config.block_sizes,
        len(tensors),
        num_blocks,
        capacity_tokens(config),
    )
    return attach_sharing(config, sharing)


class _Limits(NamedTuple):
    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int | None


def held_requests(
    config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int | None = None
) -> int:
    """Requests of `max_model_len` tokens the usable blocks hold at once after their prefill,
    while one more request prefills a step of `max_num_batched_tokens` (0 if none fits).

    A prefilled request keeps only its windows in window layers (its decode footprint); the
    step being prefilled also holds the step's tokens. This is the capacity the hybrid manager
    buys; `max_concurrency` instead charges every request a whole step, so with steps as long
    as the request windows save nothing there.
    """
    usable = config.num_blocks - 1
    steady = request_blocks(config, max_model_len, 1)
    worst = request_blocks(config, max_model_len, max_num_batched_tokens)
    if steady == 0:
        return usable
    if worst > usable:
        return 0
    return (usable - (worst - steady)) // steady


def grouping_capacity(
    groups: tuple[KVCacheGroupSpec, ...],
    memory_bytes: int,
    max_model_len: int,
    max_num_batched_tokens: int | None = None,
) -> int:
    """`held_requests` of `groups` with the blocks that `memory_bytes` hold."""
    buffers = _buffer_layout(groups)
    num_blocks = memory_bytes // sum(page for _, page in buffers)
    if num_blocks < MIN_NUM_BLOCKS:
        return 0
    config = KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=())
    return held_requests(config, max_model_len, max_num_batched_tokens)


def choose_grouping(
    hybrid: tuple[KVCacheGroupSpec, ...], owners: dict[str, KVCacheSpec], limits: _Limits
) -> tuple[KVCacheGroupSpec, ...]:
    """The hybrid grouping, unless folding every layer into full attention holds more requests
    of `max_model_len` (`held_requests`) in the same memory: with requests no longer than the
    windows, windows save nothing while unified block sizes and padding layers still cost.
    The choice and its reason are logged; models that cannot be folded (Mamba) keep the hybrid
    grouping."""
    length = limits.max_model_len
    try:
        folded = group_layers(fold_to_full_attention(owners), disable_hybrid=True)
    except ValueError as error:
        logger.info("KV cache grouping: hybrid, because folding is impossible (%s)", error)
        return hybrid
    if folded == hybrid:
        logger.info("KV cache grouping: one grouping, because no layer is windowed or chunked")
        return hybrid
    on = grouping_capacity(hybrid, *limits)
    off = grouping_capacity(folded, *limits)
    if off > on:
        logger.warning(
            "KV cache grouping: folded (every layer full attention), because it holds %d "
            "requests of %d tokens where the hybrid groups would hold %d",
            off,
            length,
            on,
        )
        return folded
    logger.info(
        "KV cache grouping: hybrid (%d groups), because it holds %d requests of %d tokens "
        "where folding every layer into full attention would hold %d",
        len(hybrid),
        on,
        length,
        off,
    )
    return hybrid


def group_of_layer(config: KVCacheConfig) -> dict[str, int]:
    """Group index of every layer, KV-sharing layers included (they use their target's)."""
    index = {name: gid for gid, group in enumerate(config.groups) for name in group.layer_names}
    for layer, target in config.shared_kv_layers:
        index[layer] = index[target]
    return index


def request_blocks(
    config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int | None = None
) -> int:
    """Blocks (summed over groups) one request of `max_model_len` tokens can hold at worst."""
    return sum(blocks_per_group(config, max_model_len, max_num_batched_tokens))


def block_bytes(config: KVCacheConfig) -> int:
    """Bytes one block ID costs over all buffers (page x layers per group)."""
    return sum(tensor.size_bytes for tensor in config.tensors) // config.num_blocks


def estimate_max_model_len(
    config: KVCacheConfig,
    memory_bytes: int,
    *,
    max_num_batched_tokens: int | None = None,
    limit: int = 1 << 40,
) -> int:
    """Largest request length (<= `limit`) whose worst-case KV fits in `memory_bytes` with this
    config's groups and layers per group; 0 if not even one token fits.

    Like the fit check, this counts bytes and ignores the null block.
    """
    if not config.groups:
        return limit
    return longest_request(
        config, memory_bytes // block_bytes(config), max_num_batched_tokens, limit
    )


def max_concurrency(
    config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int | None = None
) -> float:
    """How many worst-case requests of `max_model_len` tokens the usable blocks hold at once
    (the null block excluded)."""
    needed = request_blocks(config, max_model_len, max_num_batched_tokens)
    if needed == 0:
        return math.inf
    return (config.num_blocks - 1) / needed


def capacity_tokens(config: KVCacheConfig) -> int:
    """Reported pool capacity: blocks per group x the smallest block size (0 without groups)."""
    if not config.groups:
        return 0
    return config.num_blocks // len(config.groups) * min(config.block_sizes)


def _member_specs(spec: KVCacheSpec) -> list[KVCacheSpec]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [member for _, member in spec.kv_cache_specs]
    return [spec]


def _check_block_sizes(groups: tuple[KVCacheGroupSpec, ...]) -> None:
    """Block sizes must be multiples of the smallest (one hash granularity serves all groups);
    chunks must be whole blocks; a chunked-local group's block must equal the hit alignment."""
    sizes = [group.spec.block_size for group in groups]
    smallest = min(sizes)
    if any(size % smallest for size in sizes):
        raise ValueError(
            f"group block sizes {sizes} are not all multiples of the smallest ({smallest}), "
            "so no hash block size serves every group"
        )
    alignment = math.lcm(*sizes)
    for group in groups:
        for spec in _member_specs(group.spec):
            chunk = getattr(spec, "attention_chunk_size", None)
            if chunk is not None and chunk % spec.block_size:
                raise ValueError(
                    f"attention chunk {chunk} of layers {group.layer_names} is not a multiple "
                    f"of their block size {spec.block_size}; choose a block_size that divides "
                    f"{chunk}"
                )
        is_chunked = isinstance(manager_spec(group.spec), ChunkedLocalAttentionSpec)
        if is_chunked and group.spec.block_size != alignment:
            raise ValueError(
                f"chunked-local layers {group.layer_names} have block size "
                f"{group.spec.block_size}, but prefix hits are aligned to {alignment} tokens "
                "(groups with different block sizes); use equal page sizes or disable the "
                "hybrid manager"
            )


def _layer_page(spec: KVCacheSpec, layer: str) -> int:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.spec_of(layer).page_size_bytes
    return spec.page_size_bytes


def _buffer_layout(groups: tuple[KVCacheGroupSpec, ...]) -> list[tuple[tuple[str, ...], int]]:
    """(layers, page bytes) of each buffer: buffer i holds the i-th layer of every group."""
    num_buffers = max(len(group.layer_names) for group in groups)
    layout = []
    for i in range(num_buffers):
        members = [(g.layer_names[i], g.spec) for g in groups if i < len(g.layer_names)]
        pages = {_layer_page(spec, layer) for layer, spec in members}
        assert len(pages) == 1, f"buffer {i} mixes page sizes {pages}"
        layout.append((tuple(layer for layer, _ in members), pages.pop()))
    return layout


def _num_blocks(memory_bytes: int, bytes_per_block: int, override: int | None) -> int:
    fitting = memory_bytes // bytes_per_block
    if override is not None:
        if override < MIN_NUM_BLOCKS:
            raise ValueError(f"num_blocks_override must be >= {MIN_NUM_BLOCKS}, got {override}")
        if override > fitting:
            logger.warning(
                "num_blocks_override %d exceeds the %d blocks that fit in %d bytes",
                override,
                fitting,
                memory_bytes,
            )
        return override
    if fitting < MIN_NUM_BLOCKS:
        raise ValueError(
            f"{memory_bytes} bytes of KV cache memory hold {fitting} block(s) of {bytes_per_block} "
            f"bytes (one page of every layer of a group); at least {MIN_NUM_BLOCKS} are needed "
            "(the null block and one usable block)"
        )
    return fitting

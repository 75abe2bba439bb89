"""A rank's shard of a KV transfer between engines: the pages of some blocks of every KV cache
group, copied out of one engine's pool and into another's (`worker.kv_io.block_export` per group).

Each tensor-parallel rank exports its own shard (its heads of K/V, its slice of the recurrent
states). A receiver of the same tensor-parallel size imports shard r on rank r; one of another
size reshards on each rank: every cache tensor is rebuilt whole from the sender's shards and cut
as this rank holds it (`worker.kv_io.cache_shard_layout`, declared by each layer). Pages the
sender's offload tier holds (`TierPage`) are read from there, at their places in the group's
order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.output import TierPage
from worker.block_copies import GroupTensors, distinct_cache_tensors
from worker.kv_io.block_export import BlockPages, concat_pages, export_blocks, import_blocks
from worker.kv_io.cache_shard_layout import CacheShardLayout

ReadTierPage = Callable[[TierPage, int], BlockPages]
"""Reads one offload-tier entry's pages (the entry, its group)."""


@dataclass(frozen=True)
class KVShard:
    """One rank's pages of a transfer: per KV cache group, its blocks in transfer order."""

    rank: int
    pages: tuple[BlockPages, ...]

    @property
    def nbytes(self) -> int:
        return sum(pages.nbytes for pages in self.pages)


def export_shard(
    tensors: GroupTensors,
    num_pool_blocks: int,
    rank: int,
    block_ids: Sequence[Sequence[int]],
    tier: tuple[Sequence[Sequence[TierPage]], ReadTierPage] | None = None,
) -> KVShard:
    """Copy these blocks of every group (one list per group) into host memory; with `tier`
    (per group the offload-tier entries sent, and their reader) those join them in place."""
    pages = tuple(
        export_blocks(tensors, group_id, list(ids), num_pool_blocks)
        for group_id, ids in enumerate(block_ids)
    )
    _wait_for_copies(tensors)  # the pinned copies are read by the transport next
    if tier is not None:
        tier_pages, read = tier
        pages = tuple(
            _with_tier_pages(group_pages, entries, read)
            for group_pages, entries in zip(pages, tier_pages, strict=True)
        )
    return KVShard(rank, pages)


def _with_tier_pages(
    device: BlockPages, entries: Sequence[TierPage], read: ReadTierPage
) -> BlockPages:
    """One group's pages in transfer order: the device blocks', with the tier entries'
    inserted at their positions."""
    if not entries:
        return device
    by_position = {entry.position: read(entry, device.group_id) for entry in entries}
    parts: list[BlockPages] = []
    next_device = 0
    for position in range(device.num_blocks + len(entries)):
        if position in by_position:
            parts.append(by_position[position])
        else:
            parts.append(device.block(next_device))
            next_device += 1
    return concat_pages(parts)


def import_shard(
    tensors: GroupTensors,
    num_pool_blocks: int,
    shard: KVShard,
    selected: Sequence[Sequence[int]],
    block_ids: Sequence[Sequence[int]],
) -> None:
    """Write the shard's pages `selected[g]` (indices into group g's pages) onto `block_ids[g]`."""
    if len(shard.pages) != len(block_ids):
        raise ValueError(
            f"kv transfer: {len(shard.pages)} KV cache groups sent, this engine has "
            f"{len(block_ids)}"
        )
    for pages, indices, ids in zip(shard.pages, selected, block_ids, strict=True):
        if ids:
            import_blocks(tensors, pages.select(indices), list(ids), num_pool_blocks)
    _wait_for_copies(tensors)


def _wait_for_copies(tensors: GroupTensors) -> None:
    """Wait for the copies queued on the pool's device (none to wait for on CPU)."""
    if any(t.is_cuda for group in tensors.values() for t in group):
        torch.cuda.synchronize()


class CacheLayer(Protocol):
    """A layer owning cache tensors (attention or recurrent state)."""

    @property
    def layer_name(self) -> str: ...

    def cache_shard_layouts(self) -> tuple[CacheShardLayout, ...] | None: ...


@dataclass(frozen=True)
class TensorLayout:
    """How tensor parallelism cuts one cache tensor of a group, and the layer it belongs to."""

    group_id: int
    layer_name: str
    layer_type: str
    layout: CacheShardLayout | None
    """None: the layer does not say (its pages are never resharded)."""

    @property
    def owner(self) -> str:
        """'KV cache group 1 (MambaMixer2 layer model.layers.0.mixer)', for errors."""
        return f"KV cache group {self.group_id} ({self.layer_type} layer {self.layer_name})"


GroupLayouts = dict[int, list[TensorLayout]]
"""KV cache group -> the layout of each of its cache tensors, in `GroupTensors` order."""


def group_layouts(
    config: KVCacheConfig,
    kv_caches: Mapping[str, Sequence[torch.Tensor]],
    layers: Sequence[CacheLayer],
) -> GroupLayouts:
    """The layout of every cache tensor of every group, from the layer that owns it."""
    by_name = {layer.layer_name: layer for layer in layers}
    out: GroupLayouts = {group_id: [] for group_id in range(len(config.groups))}
    for cache in distinct_cache_tensors(config, kv_caches):
        layer = by_name[cache.layer_name]
        layouts = layer.cache_shard_layouts()
        layout = None if layouts is None else layouts[cache.cache_index]
        owner = TensorLayout(cache.group_id, layer.layer_name, type(layer).__name__, layout)
        out[cache.group_id].append(owner)
    return out


def reshard(
    shards: Sequence[KVShard],
    layouts: GroupLayouts,
    tensors: GroupTensors,
    tp_size: int,
    rank: int,
) -> KVShard:
    """Rank `rank`'s shard at `tp_size` ranks (`tensors` its pool) of pages sent by
    `len(shards)` ranks: each cache tensor rebuilt whole from theirs, then cut; ValueError
    naming the group and the layer type where a layout cannot be resharded."""
    ordered = sorted(shards, key=lambda shard: shard.rank)
    if [shard.rank for shard in ordered] != list(range(len(ordered))):
        raise ValueError(f"kv transfer: shards of ranks {[s.rank for s in ordered]} sent")
    if {len(shard.pages) for shard in ordered} != {len(layouts)}:
        raise ValueError(
            f"kv transfer: {len(ordered[0].pages)} KV cache groups sent, this engine has "
            f"{len(layouts)}"
        )
    pages = []
    for group_id, group in layouts.items():
        sent = [shard.pages[group_id] for shard in ordered]
        if {len(page.tensors) for page in sent} != {len(group)}:
            raise ValueError(f"kv transfer: pages of another KV layout in {group[0].owner}")
        pieces = [
            _reshard_tensor([page.tensors[index] for page in sent], layout, tp_size, rank)
            for index, layout in enumerate(group)
        ]
        rows = [
            _as_pool_rows(piece, tensor, sent[0].num_blocks, layout)
            for piece, tensor, layout in zip(pieces, tensors[group_id], group, strict=True)
        ]
        pages.append(BlockPages(group_id, sent[0].num_blocks, tuple(rows)))
    return KVShard(rank, tuple(pages))


def _reshard_tensor(
    pieces: list[torch.Tensor], tensor: TensorLayout, tp_size: int, rank: int
) -> torch.Tensor:
    """One cache tensor's pages: the sender ranks' pieces made whole, then this rank's cut."""
    if tensor.layout is None:
        raise ValueError(
            f"kv transfer: {tensor.owner} does not say how tensor parallelism cuts its cache, "
            "so its pages cannot be resharded"
        )
    try:
        return tensor.layout.cut(tensor.layout.gather(pieces), tp_size, rank)
    except ValueError as exc:
        raise ValueError(
            f"kv transfer: cannot reshard {tensor.owner} from tensor_parallel_size "
            f"{len(pieces)} to {tp_size}: {exc}"
        ) from None


def _as_pool_rows(
    piece: torch.Tensor, pool: torch.Tensor, num_blocks: int, tensor: TensorLayout
) -> torch.Tensor:
    """The pages in this pool's rows per block (kernel block splits may differ by engine)."""
    row_shape = tuple(pool.shape[1:])
    num_rows = piece.numel() // max(math.prod(row_shape), 1)
    if piece.numel() != num_rows * math.prod(row_shape) or num_rows % max(num_blocks, 1):
        raise ValueError(
            f"kv transfer: {tensor.owner}: pages of shape "
            f"{tuple(piece.shape)} do not fit this engine's cache rows {row_shape}"
        )
    return piece.reshape(num_rows, *row_shape)

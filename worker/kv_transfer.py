"""A rank's shard of a KV transfer between engines: the pages of some blocks of every KV cache
group, copied out of one engine's pool and into another's (`worker.block_export` per group).

Each tensor-parallel rank exports and imports its own shard (its heads of K/V, its slice of the
recurrent states), so both engines must run the same tensor-parallel size. Pages the sender's
offload tier holds (`TierPage`) are read from there, at their places in the group's order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from scheduler.output import TierPage
from worker.block_copies import GroupTensors
from worker.block_export import BlockPages, concat_pages, export_blocks, import_blocks

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

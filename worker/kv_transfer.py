"""A rank's shard of a KV transfer between engines: the pages of some blocks of every KV cache
group, copied out of one engine's pool and into another's (`worker.block_export` per group).

Each tensor-parallel rank exports and imports its own shard (its heads of K/V, its slice of the
recurrent states), so both engines must run the same tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.block_copies import GroupTensors
from worker.block_export import BlockPages, export_blocks, import_blocks


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
) -> KVShard:
    """Copy these blocks of every group (one list per group) into host memory."""
    pages = tuple(
        export_blocks(tensors, group_id, list(ids), num_pool_blocks)
        for group_id, ids in enumerate(block_ids)
    )
    _wait_for_copies(tensors)  # the pinned copies are read by the transport next
    return KVShard(rank, pages)


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

"""Export and import of one KV cache group's blocks: the unit every move of KV out of the device
pool and back is made of (the offload tier; transfers between engines build on it too).

A group's blocks are, in every distinct cache tensor of its layers (K, V, conv state, SSM state;
the donors only: KV-sharing layers alias their target's tensors), `split` rows per pool block.
`export_blocks` gathers those rows into `BlockPages` (host memory by default), `import_blocks`
scatters them back onto other block IDs of the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.block_copies import GroupTensors, block_rows


@dataclass(frozen=True)
class BlockPages:
    """The contents of some blocks of one KV cache group, in block order."""

    group_id: int
    num_blocks: int
    tensors: tuple[torch.Tensor, ...]
    """One per cache tensor of the group, in `GroupTensors` order: [num_blocks * split, ...]."""

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    def block(self, index: int) -> BlockPages:
        """The pages of the `index`-th block alone (views, no copy)."""
        views = []
        for tensor in self.tensors:
            split = tensor.shape[0] // self.num_blocks
            views.append(tensor[index * split : (index + 1) * split])
        return BlockPages(self.group_id, 1, tuple(views))

    def select(self, indices: Sequence[int]) -> BlockPages:
        """The pages of these blocks, in the given order (all of them: no copy)."""
        if list(indices) == list(range(self.num_blocks)):
            return self
        picked = []
        for tensor in self.tensors:
            split = tensor.shape[0] // self.num_blocks
            picked.append(tensor[block_rows(list(indices), split, tensor.device)])
        return BlockPages(self.group_id, len(indices), tuple(picked))


def concat_pages(parts: Sequence[BlockPages]) -> BlockPages:
    """The pages of `parts` (one group's, all on one device) one after another."""
    assert parts, "nothing to join"
    if len(parts) == 1:
        return parts[0]
    group_ids = {part.group_id for part in parts}
    assert len(group_ids) == 1, f"pages of several groups: {group_ids}"
    tensors = tuple(torch.cat(column) for column in zip(*(p.tensors for p in parts), strict=True))
    return BlockPages(parts[0].group_id, sum(p.num_blocks for p in parts), tensors)


def export_blocks(
    tensors: GroupTensors,
    group_id: int,
    block_ids: Sequence[int],
    num_pool_blocks: int,
    device: torch.device | str = "cpu",
) -> BlockPages:
    """Copy these blocks of the group out of the pool onto `device` (pinned host memory when
    the pool is on CUDA and `device` is the CPU; the copy is then asynchronous on the current
    stream: read it after a synchronisation)."""
    out = []
    for tensor in tensors[group_id]:
        split = tensor.shape[0] // num_pool_blocks
        rows = tensor[block_rows(list(block_ids), split, tensor.device)]
        if rows.device == torch.device(device):
            out.append(rows)
            continue
        host = torch.empty(rows.shape, dtype=rows.dtype, device=device, pin_memory=rows.is_cuda)
        host.copy_(rows, non_blocking=True)
        out.append(host)
    return BlockPages(group_id, len(block_ids), tuple(out))


def import_blocks(
    tensors: GroupTensors, pages: BlockPages, block_ids: Sequence[int], num_pool_blocks: int
) -> None:
    """Write `pages` into these blocks of its group (asynchronous on the current stream when the
    pages are pinned host memory and the pool is on CUDA)."""
    assert pages.num_blocks == len(block_ids), (pages.num_blocks, block_ids)
    group = tensors[pages.group_id]
    assert len(group) == len(pages.tensors), "pages of another KV layout"
    for tensor, source in zip(group, pages.tensors, strict=True):
        split = tensor.shape[0] // num_pool_blocks
        assert source.shape[1:] == tensor.shape[1:], "pages of another KV layout"
        assert source.dtype == tensor.dtype, "pages of another KV dtype"
        rows = block_rows(list(block_ids), split, tensor.device)
        tensor[rows] = source.to(tensor.device, non_blocking=True)

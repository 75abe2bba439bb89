"""Block copies of the KV pool, and the recurrent states kept at fine checkpoints.

The scheduler's fine prefix hits (`scheduler.kv_cache.checkpoints`) need two things a step does
not do by itself: copying one block's pages onto another block of the same group (before the
forward: a hit starts from a copy of a checkpoint; after it: a checkpoint keeps a copy of a
partly filled attention block), and keeping a Mamba state at a position inside a step's tokens
(a cut of the scan, see `worker.state.mamba_metadata`) or at its end (a copy of the state written).

Every layer cache is a tensor (or a pair) whose leading dimension holds `split` rows per pool
block (the attention kernel block split; 1 for Mamba states), so one copy is the same row
gather/scatter in every layer of the group. All sources are read before any destination is
written: a block may be a copy's source and, popped again by the pool, another one's destination.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import torch

from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.output import BlockCopy, StateSave

GroupTensors = dict[int, list[torch.Tensor]]
"""KV cache group -> every distinct cache tensor of its layers (K, V, conv state, SSM state)."""


def group_tensors(
    config: KVCacheConfig, kv_caches: Mapping[str, Sequence[torch.Tensor]]
) -> GroupTensors:
    """The cache tensors of each group's layers (aliases of KV-sharing layers once)."""
    out: GroupTensors = {group_id: [] for group_id in range(len(config.groups))}
    for cache in distinct_cache_tensors(config, kv_caches):
        out[cache.group_id].append(cache.tensor)
    return out


class CacheTensor(NamedTuple):
    """One distinct cache tensor of a group: the first layer viewing it, and which of its
    caches it is."""

    group_id: int
    layer_name: str
    cache_index: int
    """Its place in the layer's caches (K 0, V 1; conv state 0, SSM state 1)."""
    tensor: torch.Tensor


def distinct_cache_tensors(
    config: KVCacheConfig, kv_caches: Mapping[str, Sequence[torch.Tensor]]
) -> Iterator[CacheTensor]:
    """Each group's cache tensors in `GroupTensors` order: views of one memory with the same
    strides (a layer's K = V, a KV-sharing layer's aliases) once."""
    for group_id, group in enumerate(config.groups):
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name in group.layer_names:
            for index, tensor in enumerate(kv_caches[name]):
                key = (tensor.data_ptr(), tuple(tensor.stride()))
                if key not in seen:
                    seen.add(key)
                    yield CacheTensor(group_id, name, index, tensor)


def copy_blocks(copies: Iterable[BlockCopy], tensors: GroupTensors, num_blocks: int) -> None:
    """Copy each source block's rows onto its destination, group by group."""
    by_group: dict[int, tuple[list[int], list[int]]] = {}
    for copy in copies:
        sources, targets = by_group.setdefault(copy.group_id, ([], []))
        sources.append(copy.src)
        targets.append(copy.dst)
    for group_id, (sources, targets) in by_group.items():
        for tensor in tensors[group_id]:
            split = tensor.shape[0] // num_blocks
            src = block_rows(sources, split, tensor.device)
            dst = block_rows(targets, split, tensor.device)
            tensor[dst] = tensor[src]


def block_rows(blocks: list[int], split: int, device: torch.device) -> torch.Tensor:
    """Leading-dimension rows of these pool blocks in a tensor with `split` rows per block."""
    ids = torch.tensor(blocks, dtype=torch.int64, device=device)
    if split == 1:
        return ids
    return (ids[:, None] * split + torch.arange(split, device=device)).reshape(-1)


def saves_by_request(saves: Iterable[StateSave]) -> dict[int, dict[str, list[tuple[int, int]]]]:
    """Group -> request -> [(tokens, block)] of the state saves of one step."""
    out: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for save in saves:
        per_request = out.setdefault(save.group_id, {})
        per_request.setdefault(save.req_id, []).append((save.num_tokens, save.block_id))
    return out

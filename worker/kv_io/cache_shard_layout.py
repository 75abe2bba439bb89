"""How tensor parallelism cuts one cache tensor (K, V, conv state, SSM state) over the ranks,
declared by each layer next to its cache spec, so that pages written at one tensor-parallel size
can be rebuilt whole and cut again for another (KV transfers between engines).

Along one dimension (`dim`, counted from the end, so the block rows in front do not matter), a
cache tensor is a run of parts, each dealt out to the ranks on its own:

    Mamba-2 conv state channels:   | x: heads x head_dim | B: groups x N | C: groups x N |
    rank r of tp holds, of a part of U units, units [r * U // tp, + max(U // tp, 1))

so a part with fewer units than ranks (KV heads, one B/C group) is replicated: each unit on
tp / U ranks; a part of one unit is on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CachePart:
    """`num_units` units (heads, groups, channels) of `unit_size` elements each, whole model."""

    num_units: int
    unit_size: int = 1

    def check_tp_size(self, tp_size: int) -> None:
        """ValueError when the units cannot be dealt evenly to `tp_size` ranks."""
        if self.num_units % tp_size and tp_size % self.num_units:
            raise ValueError(
                f"{self.num_units} units cannot be split over, nor replicated on, "
                f"tp_size={tp_size} ranks"
            )

    def rank_units(self, tp_size: int, rank: int) -> tuple[int, int]:
        """(first unit, number of units) rank `rank` of `tp_size` holds."""
        return rank * self.num_units // tp_size, max(self.num_units // tp_size, 1)

    def rank_size(self, tp_size: int) -> int:
        """Elements one rank holds along the split dimension."""
        return self.rank_units(tp_size, 0)[1] * self.unit_size


@dataclass(frozen=True)
class CacheShardLayout:
    """One cache tensor's cut: along `dim` (negative), its `parts` one after another."""

    dim: int
    parts: tuple[CachePart, ...]

    def __post_init__(self) -> None:
        assert self.dim < 0, "dim counts from the end: block rows lead every cache tensor"

    def gather(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole tensor from every rank's piece (rank order; `len(pieces)` ranks)."""
        tp_size = len(pieces)
        for part in self.parts:
            part.check_tp_size(tp_size)
        expected = sum(part.rank_size(tp_size) for part in self.parts)
        sizes = {piece.shape[self.dim] for piece in pieces}
        if sizes != {expected}:
            raise ValueError(f"pieces of {sizes} elements, {expected} expected at tp {tp_size}")
        whole: list[torch.Tensor] = []
        offset = 0
        for part in self.parts:
            size = part.rank_size(tp_size)
            firsts = [part.rank_units(tp_size, rank)[0] for rank in range(tp_size)]
            # the first rank holding each unit range (replicas of it are the same pages)
            holders = [
                rank for rank in range(tp_size) if rank == 0 or firsts[rank - 1] != firsts[rank]
            ]
            whole.extend(pieces[rank].narrow(self.dim, offset, size) for rank in holders)
            offset += size
        return torch.cat(whole, dim=self.dim)

    def cut(self, whole: torch.Tensor, tp_size: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s piece of the whole tensor at `tp_size` ranks."""
        pieces: list[torch.Tensor] = []
        offset = 0
        for part in self.parts:
            part.check_tp_size(tp_size)
            first, count = part.rank_units(tp_size, rank)
            start = offset + first * part.unit_size
            pieces.append(whole.narrow(self.dim, start, count * part.unit_size))
            offset += part.num_units * part.unit_size
        if offset != whole.shape[self.dim]:
            raise ValueError(f"a tensor of {whole.shape[self.dim]} elements, {offset} expected")
        return torch.cat(pieces, dim=self.dim) if len(pieces) > 1 else pieces[0]


def heads_layout(dim: int, num_heads: int) -> CacheShardLayout:
    """A tensor split by whole heads along `dim` (KV caches, SSM and recurrent states)."""
    return CacheShardLayout(dim, (CachePart(num_heads),))

"""Batched LoRA matmuls over a mixed-adapter batch: the step's row layout and the torch reference.

`lora_segments` turns a step's per-row adapter slots into `LoRASegments` once per step; every
projection's `lora_shrink` (x @ A^T, [rows, R]) and `lora_expand` (out + shrunk @ B^T) reuses it.
Tokens that use an adapter are grouped by slot into segments; tokens without one are in no
segment and cost nothing. The scaling (alpha / r) is folded into B when an adapter is loaded.

    row_slots = [ 0 0 0 . 2 . 1 2 2 2 ]           (. = no adapter)
    token_idx = [ 0 1 2 | 6 | 4 7 8 9 ]     slot_ids = (0, 1, 2), lengths = (3, 1, 4)
                  slot 0  s1  slot 2

The reference here loops over segments; `kernels.lora_torch` (batched matmuls) and
`kernels.triton_lora` (per-row slot indices) compute the same numbers faster.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

PAD_WASTE_LIMIT = 2.0
"""Padded batched matmuls are used while slots x longest segment <= this x adapted rows."""


class LoRALayout(enum.Enum):
    """How the torch path batches a step's adapter matmuls (chosen by shape, once per step)."""

    ONE_ADAPTER = "one_adapter"
    """Every row uses the same slot: two plain matmuls, no gather or scatter."""
    PADDED = "padded"
    """Decode-like: segments padded to one length, two batched matmuls for any adapter count."""
    SEGMENTS = "segments"
    """Long, uneven segments (prefill): one pair of matmuls per segment."""


@dataclass(frozen=True)
class LoRASegments:
    """A step's adapter rows, grouped by device slot, with the indices every backend needs."""

    token_idx: torch.Tensor  # [N] int64: rows of the batch, grouped by slot
    slot_ids: tuple[int, ...]
    """Device slot of each segment."""
    lengths: tuple[int, ...]
    """Rows in each segment (same order as `slot_ids`)."""
    row_slots: torch.Tensor | None = None  # [T] int32: each row's slot, negative for none
    layout: LoRALayout = LoRALayout.SEGMENTS
    padded_idx: torch.Tensor | None = None  # [k * L] int64: segment rows padded to L each
    pad_mask: torch.Tensor | None = None  # [k, L, 1] bool: real rows (None: no padding)
    used_slots: torch.Tensor | None = None  # [k] int64: `slot_ids` on the device
    slot_range: tuple[int, int] | None = None
    """(first, end) when `slot_ids` are consecutive, so the slots' weights are a view."""

    @property
    def num_rows(self) -> int:
        return int(self.token_idx.shape[0])


def lora_segments(row_slots: torch.Tensor, device: torch.device) -> LoRASegments | None:
    """The segments of rows where row `i` uses slot `row_slots[i]` (an integer tensor, negative:
    no adapter): a step's rows, or one MoE expert's routed rows; None when no row uses one."""
    rows = torch.nonzero(row_slots >= 0).flatten()
    if rows.numel() == 0:
        return None
    adapted = row_slots[rows]
    order = torch.argsort(adapted, stable=True)
    token_idx = rows[order]
    slot_tensor, counts = torch.unique_consecutive(adapted[order], return_counts=True)
    slot_ids, lengths = tuple(slot_tensor.tolist()), tuple(counts.tolist())
    num_slots, longest = len(slot_ids), max(lengths)
    first = slot_ids[0]
    consecutive = slot_ids == tuple(range(first, first + num_slots))
    if num_slots == 1 and len(token_idx) == len(row_slots):
        layout = LoRALayout.ONE_ADAPTER
    elif num_slots * longest <= PAD_WASTE_LIMIT * len(token_idx):
        layout = LoRALayout.PADDED
    else:
        layout = LoRALayout.SEGMENTS
    padded_idx, pad_mask = _padded_rows(token_idx, counts, longest)
    return LoRASegments(
        token_idx=token_idx.to(device),
        slot_ids=slot_ids,
        lengths=lengths,
        row_slots=row_slots.to(device=device, dtype=torch.int32),
        layout=layout,
        padded_idx=padded_idx.to(device),
        pad_mask=None if pad_mask is None else pad_mask.to(device),
        used_slots=slot_tensor.to(device),
        slot_range=(first, first + num_slots) if consecutive else None,
    )


def _padded_rows(
    token_idx: torch.Tensor, counts: torch.Tensor, longest: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each segment's rows padded to `longest` by repeating its first row, and which are real."""
    starts = torch.cumsum(counts, 0) - counts  # [k]
    offsets = torch.arange(longest)  # [L]
    is_real = offsets[None, :] < counts[:, None]  # [k, L]
    source = starts[:, None] + torch.where(is_real, offsets[None, :], 0)
    padded_idx = token_idx[source].flatten()
    return padded_idx, None if bool(is_real.all()) else is_real.unsqueeze(-1)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """[T, in] x, [slots, R, in] A -> [N, R]: each segment's rows times its slot's A^T."""
    rows = x.index_select(0, segments.token_idx)  # [N, in]
    parts = [
        part @ lora_a[slot].t()
        for slot, part in zip(
            segments.slot_ids, torch.split(rows, list(segments.lengths)), strict=True
        )
    ]
    return torch.cat(parts) if parts else rows.new_zeros((0, lora_a.shape[1]))


def lora_expand(
    out: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments
) -> torch.Tensor:
    """out [T, out_features] + (shrunk [N, R] @ B[slot]^T) in each segment's rows (a new tensor)."""
    parts = [
        part @ lora_b[slot].t()
        for slot, part in zip(
            segments.slot_ids, torch.split(shrunk, list(segments.lengths)), strict=True
        )
    ]
    if not parts:
        return out
    delta = torch.cat(parts).to(out.dtype)  # [N, out_features]
    return out.index_add(0, segments.token_idx, delta)

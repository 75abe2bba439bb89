"""Batched LoRA matmuls over a mixed-adapter batch: the torch reference (and the CPU path).

A step's tokens that use an adapter are grouped by adapter slot into segments (`LoRASegments`).
`lora_shrink` computes x @ A^T for each segment's rows against its slot's A ([N, R], segment order);
`lora_expand` adds that @ B^T into the output rows. Tokens without an adapter are in no segment
and cost nothing. The scaling (alpha / r) is folded into B when an adapter is loaded.

    rows:  token_idx = [ 3 7 8 | 0 1 2 | 9 ]     slot_ids = [2, 0, 5], lengths = [3, 3, 1]
                        slot 2   slot 0  slot 5
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoRASegments:
    """A step's adapter rows, grouped by device slot."""

    token_idx: torch.Tensor  # [N] int64: rows of the batch, grouped by slot
    slot_ids: tuple[int, ...]
    """Device slot of each segment."""
    lengths: tuple[int, ...]
    """Rows in each segment (same order as `slot_ids`)."""
    row_slots: torch.Tensor | None = None  # [T] int64: each batch row's slot, -1 for none
    """Per-row slots, for layers that pick rows themselves (routed MoE experts)."""

    @property
    def num_rows(self) -> int:
        return int(self.token_idx.shape[0])


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

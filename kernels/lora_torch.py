"""Batched torch LoRA matmuls (the CPU path): the fewest kernel launches for each step's layout.

Same signatures and numbers as `kernels.lora_reference`; the layout chosen once per step
(`LoRASegments.layout`) picks the code:

- ONE_ADAPTER: x @ A^T, then addmm into the output; no gather or scatter.
- PADDED: segments padded to one length L ([k, L] row indices), two `bmm`s against the
  step's k slots (a view when the slots are consecutive), one index_add, for any k.
- SEGMENTS: the reference's loop (long prefill segments, where each matmul is large).

The shrunk tensor's shape follows the layout ([T, R], [k, L, R] or [N, R]); only the matching
`lora_expand` reads it.
"""

from __future__ import annotations

import torch

from kernels import lora_reference
from kernels.lora_reference import LoRALayout, LoRASegments


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """x [T, in] times each row's slot's A^T (layout-shaped; see the module docstring)."""
    if segments.layout is LoRALayout.ONE_ADAPTER:
        return x @ lora_a[segments.slot_ids[0]].t()  # [T, R]
    if segments.layout is LoRALayout.SEGMENTS:
        return lora_reference.lora_shrink(x, lora_a, segments)
    assert segments.padded_idx is not None
    rows = x.index_select(0, segments.padded_idx)  # [k * L, in]
    rows = rows.view(len(segments.slot_ids), -1, x.shape[1])  # [k, L, in]
    shrunk = torch.bmm(rows, _slot_weights(lora_a, segments).transpose(1, 2))  # [k, L, R]
    if segments.pad_mask is not None:  # padding rows repeat a real row: add nothing for them
        shrunk = shrunk * segments.pad_mask
    return shrunk


def lora_expand(
    out: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments
) -> torch.Tensor:
    """out [T, out_features] + each row's shrunk @ its slot's B^T (a new tensor)."""
    if segments.layout is LoRALayout.ONE_ADAPTER:
        return torch.addmm(out, shrunk, lora_b[segments.slot_ids[0]].t().to(out.dtype))
    if segments.layout is LoRALayout.SEGMENTS:
        return lora_reference.lora_expand(out, shrunk, lora_b, segments)
    assert segments.padded_idx is not None
    delta = torch.bmm(shrunk, _slot_weights(lora_b, segments).transpose(1, 2))  # [k, L, out]
    return out.index_add(0, segments.padded_idx, delta.flatten(0, 1).to(out.dtype))


def _slot_weights(weights: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """[k, ...]: the step's slots of `weights` in segment order (a view when consecutive)."""
    if segments.slot_range is not None:
        first, end = segments.slot_range
        return weights[first:end]
    assert segments.used_slots is not None
    return weights.index_select(0, segments.used_slots)

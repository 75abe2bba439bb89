"""Triton LoRA matmuls with per-row slot indices (punica's bgmv): one launch per projection for
any mix of adapters.

    shrink: grid (T, cdiv(R, BLOCK_R))        program: row t, rank block -> shrunk[t, block]
    expand: grid (T, cdiv(out, BLOCK_N))      program: row t, output block += shrunk[t] @ B^T

Each program reads its row's slot from `LoRASegments.row_slots` and returns at once when it is
negative (no adapter), so such rows cost one load. Same numbers as `kernels.lora_reference`;
the shrunk tensor is [T, R] fp32 (rows without an adapter are zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_reference import LoRASegments

_BLOCK_K = 64
"""Input features per step of the shrink's reduction loop."""
_BLOCK_N = 64
"""Output features per expand program."""


@triton.jit  # type: ignore[untyped-decorator]
def _lora_shrink_kernel(  # type: ignore[no-untyped-def]
    x_ptr, a_ptr, slots_ptr, out_ptr, in_features, rank,
    stride_x, stride_a_slot, stride_a_rank, stride_out,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    ranks = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < rank
    acc = tl.zeros((BLOCK_R,), tl.float32)
    a_rows = a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank
    for start in range(0, in_features, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        col_ok = cols < in_features
        x = tl.load(x_ptr + row * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        a = tl.load(a_rows + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + row * stride_out + ranks, acc, mask=rank_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _lora_expand_kernel(  # type: ignore[no-untyped-def]
    shrunk_ptr, b_ptr, slots_ptr, out_ptr, out_features, rank,
    stride_shrunk, stride_b_slot, stride_b_out, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    acc = tl.zeros((BLOCK_N,), tl.float32)
    b_rows = b_ptr + slot * stride_b_slot + cols[:, None] * stride_b_out
    for start in range(0, rank, BLOCK_R):
        ranks = start + tl.arange(0, BLOCK_R)
        rank_ok = ranks < rank
        s = tl.load(shrunk_ptr + row * stride_shrunk + ranks, mask=rank_ok, other=0.0)
        b = tl.load(b_rows + ranks[None, :], mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    out_offs = out_ptr + row * stride_out + cols
    base = tl.load(out_offs, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out_offs, (base + acc).to(out_ptr.dtype.element_ty), mask=col_ok)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """[T, in] x, [slots, R, in] A -> [T, R] fp32: each adapted row times its slot's A^T."""
    row_slots = _checked_row_slots(x, segments)
    x = x if x.stride(1) == 1 else x.contiguous()
    assert lora_a.dim() == 3, "A is [slots, R, in]"
    assert lora_a.shape[2] == x.shape[1], "A is [slots, R, in]"
    assert lora_a.stride(2) == 1, "A's rows must be contiguous"
    num_tokens, rank = x.shape[0], lora_a.shape[1]
    shrunk = torch.zeros((num_tokens, rank), dtype=torch.float32, device=x.device)
    block_r = min(triton.next_power_of_2(rank), 64)
    grid = (num_tokens, triton.cdiv(rank, block_r))
    _lora_shrink_kernel[grid](
        x, lora_a, row_slots, shrunk, x.shape[1], rank,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    return shrunk


def lora_expand(
    out: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments
) -> torch.Tensor:
    """Adds each adapted row's shrunk [T, R] @ its slot's B^T into `out` [T, out_features]
    (in place) and returns `out`."""
    row_slots = _checked_row_slots(out, segments)
    assert lora_b.dim() == 3, "B is [slots, out, R]"
    assert lora_b.shape[1] == out.shape[1], "B is [slots, out, R]"
    assert shrunk.shape == (out.shape[0], lora_b.shape[2]), "shrunk is [T, R]"
    assert lora_b.stride(2) == 1, "B's rows must be contiguous"
    assert out.stride(1) == 1, "out's rows must be contiguous"
    num_tokens, out_features, rank = out.shape[0], out.shape[1], lora_b.shape[2]
    block_r = min(triton.next_power_of_2(rank), 64)
    grid = (num_tokens, triton.cdiv(out_features, _BLOCK_N))
    _lora_expand_kernel[grid](
        shrunk, lora_b, row_slots, out, out_features, rank,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_N=_BLOCK_N, BLOCK_R=block_r,
    )  # fmt: skip
    return out


def _checked_row_slots(rows: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    row_slots = segments.row_slots
    assert row_slots is not None, "the Triton kernels need LoRASegments.row_slots"
    assert row_slots.shape == (rows.shape[0],), "one slot per row"
    assert row_slots.device == rows.device, "row_slots live on the rows' device"
    assert row_slots.dtype == torch.int32, "row_slots are int32"
    return row_slots

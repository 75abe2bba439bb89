"""Triton Mamba-2 kernels with the signatures of `kernels.mamba_reference`.

`causal_conv1d`: one program per (token, block of channels) reads the `width` inputs ending at
its token, from the sequence's conv state for positions before the sequence start. A decode
step (one token per sequence, no cuts) takes one program per (sequence, block of channels) that
also writes the state it leaves, so the step is one launch and no gather.
`ssd_scan`: one program per (sequence, head, block of head_dim rows) keeps its slice of the
state `[BLOCK_P, state]` in registers and walks the sequence's tokens (the recurrent form: exact
like the chunked reference, linear in tokens; decodes and short chunks are its common case),
storing the state after any token that ends at a cut and after the last token.
Conv states left by a step are gathered from the inputs (`collect_conv_states`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.mamba_reference import (
    ConvOutput,
    ScanOutput,
    as_host_list,
    collect_conv_states,
    seq_of_positions,
)


@triton.jit  # type: ignore[untyped-decorator]
def _conv_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, b_ptr, init_ptr, out_ptr, seq_ptr, start_ptr, dim,
    stride_xt, stride_is, stride_id, stride_ik, stride_ot,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_dim = chans < dim
    seq = tl.load(seq_ptr + token)
    start = tl.load(start_ptr + seq)
    local = token - start
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(WIDTH):
        pos = local + k  # position in [conv state | sequence tokens]
        from_state = pos < WIDTH - 1
        state_val = tl.load(
            init_ptr + seq * stride_is + chans * stride_id + pos * stride_ik,
            mask=in_dim & from_state, other=0.0,
        )  # fmt: skip
        x_val = tl.load(
            x_ptr + (start + pos - (WIDTH - 1)) * stride_xt + chans,
            mask=in_dim & (pos >= WIDTH - 1), other=0.0,
        )  # fmt: skip
        weight = tl.load(w_ptr + chans * WIDTH + k, mask=in_dim, other=0.0).to(tl.float32)
        acc += weight * tl.where(from_state, state_val.to(tl.float32), x_val.to(tl.float32))
    if HAS_BIAS:
        acc += tl.load(b_ptr + chans, mask=in_dim, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + token * stride_ot + chans, acc.to(out_ptr.dtype.element_ty), mask=in_dim)


@triton.jit  # type: ignore[untyped-decorator]
def _conv_decode_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, b_ptr, init_ptr, out_ptr, final_ptr, dim,
    stride_xt, stride_is, stride_id, stride_ik, stride_ot, stride_fs, stride_fd,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # One token per sequence: the window is [conv state | the token]; the state it leaves is
    # that window shifted by one, written here too (no gather after the launch).
    seq = tl.program_id(0)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_dim = chans < dim
    final_row = final_ptr + seq * stride_fs + chans * stride_fd
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(WIDTH - 1):
        state_ptr = init_ptr + seq * stride_is + chans * stride_id + k * stride_ik
        state_val = tl.load(state_ptr, mask=in_dim, other=0.0).to(final_ptr.dtype.element_ty)
        weight = tl.load(w_ptr + chans * WIDTH + k, mask=in_dim, other=0.0).to(tl.float32)
        acc += weight * state_val.to(tl.float32)
        if k > 0:
            tl.store(final_row + (k - 1), state_val, mask=in_dim)
    x_val = tl.load(x_ptr + seq * stride_xt + chans, mask=in_dim, other=0.0)
    weight = tl.load(w_ptr + chans * WIDTH + WIDTH - 1, mask=in_dim, other=0.0).to(tl.float32)
    acc += weight * x_val.to(tl.float32)
    tl.store(final_row + (WIDTH - 2), x_val, mask=in_dim)
    if HAS_BIAS:
        acc += tl.load(b_ptr + chans, mask=in_dim, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + seq * stride_ot + chans, acc.to(out_ptr.dtype.element_ty), mask=in_dim)


def _token_seqs(starts: list[int], device: torch.device) -> torch.Tensor:
    lengths = torch.tensor([starts[i + 1] - starts[i] for i in range(len(starts) - 1)])
    seqs = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), lengths)
    return seqs.to(device)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    activation: str | None = "silu",
    cut_positions: Sequence[int] = (),
) -> ConvOutput:
    """See `kernels.mamba_reference.causal_conv1d`."""
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    starts = as_host_list(query_start_loc)
    x = x.contiguous()
    weight = weight.contiguous()
    num_tokens, dim = x.shape
    if weight.shape[1] > 1 and not cut_positions and starts == list(range(num_tokens + 1)):
        return _conv_decode(x, weight, bias, initial_states, activation)
    out = torch.empty_like(x)
    if num_tokens:
        start_t = torch.tensor(starts[:-1], dtype=torch.int32, device=x.device)
        block_d = min(128, triton.next_power_of_2(dim))
        grid = (num_tokens, triton.cdiv(dim, block_d))
        _conv_kernel[grid](
            x, weight, bias if bias is not None else weight, initial_states, out,
            _token_seqs(starts, x.device), start_t, dim,
            x.stride(0), *initial_states.stride(), out.stride(0),
            WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=activation == "silu",
            BLOCK_D=block_d,
        )  # fmt: skip
    final, cut = collect_conv_states(x, initial_states, starts, cut_positions)
    return ConvOutput(out, final, cut)


def _conv_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    activation: str | None,
) -> ConvOutput:
    """One token per sequence (a decode step): output and final states from one launch."""
    num_seqs, dim = x.shape
    width = weight.shape[1]
    out = torch.empty_like(x)
    final = torch.empty(num_seqs, dim, width - 1, dtype=x.dtype, device=x.device)
    if num_seqs:
        block_d = min(256, triton.next_power_of_2(dim))
        _conv_decode_kernel[(num_seqs, triton.cdiv(dim, block_d))](
            x, weight, bias if bias is not None else weight, initial_states, out, final, dim,
            x.stride(0), *initial_states.stride(), out.stride(0), final.stride(0),
            final.stride(1), WIDTH=width, HAS_BIAS=bias is not None,
            SILU=activation == "silu", BLOCK_D=block_d,
        )  # fmt: skip
    return ConvOutput(out, final, final.new_empty(0, dim, width - 1))


@triton.jit  # type: ignore[untyped-decorator]
def _scan_kernel(  # type: ignore[no-untyped-def]
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dtb_ptr, init_ptr, out_ptr, final_ptr, cut_ptr,
    cut_idx_ptr, qsl_ptr, num_heads, head_dim, state_size, heads_per_group, dt_min, dt_max,
    stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_ot, stride_oh,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < head_dim
    col_ok = cols < state_size
    tile_ok = row_ok[:, None] & col_ok[None, :]
    group = head // heads_per_group
    tile = (rows[:, None] * state_size + cols[None, :]).to(tl.int64)
    head_base = (seq * num_heads + head).to(tl.int64) * head_dim * state_size
    state = tl.load(init_ptr + head_base + tile, mask=tile_ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    d = tl.load(d_ptr + head).to(tl.float32) if HAS_D else 0.0
    dt_bias = tl.load(dtb_ptr + head).to(tl.float32) if HAS_DT_BIAS else 0.0
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    for token in range(start, end):
        dt = tl.load(dt_ptr + token * stride_dtt + head).to(tl.float32) + dt_bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        x = tl.load(x_ptr + token * stride_xt + head * stride_xh + rows, mask=row_ok, other=0.0)
        x = x.to(tl.float32)
        b = tl.load(b_ptr + token * stride_bt + group * stride_bg + cols, mask=col_ok, other=0.0)
        c = tl.load(c_ptr + token * stride_ct + group * stride_cg + cols, mask=col_ok, other=0.0)
        state = state * tl.exp(dt * a) + (dt * x)[:, None] * b.to(tl.float32)[None, :]
        y = tl.sum(state * c.to(tl.float32)[None, :], axis=1) + d * x
        out_offs = token * stride_ot + head * stride_oh + rows
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=row_ok)
        cut = tl.load(cut_idx_ptr + token)
        cut_base = (cut * num_heads + head).to(tl.int64) * head_dim * state_size
        tl.store(cut_ptr + cut_base + tile, state, mask=tile_ok & (cut >= 0))
    tl.store(final_ptr + head_base + tile, state, mask=tile_ok)


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    cut_positions: Sequence[int] = (),
) -> ScanOutput:
    """See `kernels.mamba_reference.ssd_scan` (`chunk_size` is unused: recurrent form)."""
    del chunk_size
    starts = as_host_list(query_start_loc)
    seq_of_positions(starts, list(cut_positions))  # validates the cuts
    num_tokens, num_heads, head_dim = x.shape
    state_size = B.shape[2]
    device = x.device
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    init = initial_states.float().contiguous()
    num_seqs = len(starts) - 1
    out = torch.empty_like(x)
    final = torch.empty(num_seqs, num_heads, head_dim, state_size, device=device)
    cut = torch.empty(len(cut_positions), num_heads, head_dim, state_size, device=device)
    cut_idx = torch.full((max(num_tokens, 1),), -1, dtype=torch.int32)
    for k, pos in enumerate(cut_positions):
        cut_idx[pos - 1] = k
    if num_seqs:
        block_p = min(32, triton.next_power_of_2(head_dim))
        grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
        _scan_kernel[grid](
            x, dt, A.float().contiguous(), B, C, D if D is not None else A,
            dt_bias if dt_bias is not None else A, init, out, final, cut, cut_idx.to(device),
            torch.tensor(starts, dtype=torch.int32, device=device), num_heads, head_dim,
            state_size, num_heads // B.shape[1], float(dt_limit[0]), float(dt_limit[1]),
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0),
            C.stride(1), out.stride(0), out.stride(1),
            HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, BLOCK_P=block_p,
            BLOCK_N=triton.next_power_of_2(state_size),
        )  # fmt: skip
    return ScanOutput(out, final, cut)

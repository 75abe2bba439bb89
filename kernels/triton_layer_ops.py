"""Triton kernels of the decoder layer's elementwise operations: (residual add +) RMSNorm,
rotary embedding in place, SiLU-and-mul, the gated DeltaNet's output-gated RMSNorm; one launch
each, signatures of `kernels.layer_ops_reference`.

One program per row (token, or head for the gated norm): the row is read once, its statistics in
fp32, and written once. The rotary kernel rotates one token's heads in place; the SiLU kernel
reads the gate and up halves of one row of the merged projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    sum_ptr,
    x_ptr,
    residual_ptr,
    weight_ptr,
    x_row_stride,
    residual_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FP32_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    # Arithmetic in fp32, rounded to the activation dtype where torch rounds (the sum, the
    # normalised rows of a Llama norm, the result).
    xf = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        x = (xf + residual.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * hidden + cols, x, mask=mask)
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP32_SCALE:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        out = xf * rstd * weight
    else:
        out = (xf * rstd).to(dtype).to(tl.float32) * weight
    tl.store(out_ptr + row * hidden + cols, out.to(dtype), mask=mask)


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    fp32_scale: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,)
    assert weight.is_contiguous()
    rows = x.reshape(-1, hidden)
    assert rows.stride(-1) == 1, "rows must be contiguous in the hidden dimension"
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    summed = out
    if residual is not None:
        residual = residual.reshape(-1, hidden)
        assert residual.shape == rows.shape
        assert residual.stride(-1) == 1
        summed = torch.empty_like(out)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            out,
            summed,
            rows,
            rows if residual is None else residual,
            weight,
            rows.stride(0),
            rows.stride(0) if residual is None else residual.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            FP32_SCALE=fp32_scale,
            BLOCK=triton.next_power_of_2(hidden),
        )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_scale: bool) -> torch.Tensor:
    """[..., hidden] -> RMS-normalised rows scaled by `weight` (in fp32 when `fp32_scale`)."""
    return _norm(x, None, weight, eps, fp32_scale)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fp32_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one launch."""
    return _norm(x, residual, weight, eps, fp32_scale)


@triton.jit  # type: ignore[untyped-decorator]
def _rotary_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    cos_ptr,
    sin_ptr,
    token_stride,
    head_stride,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    table = token * 2 * HALF + cols
    cos_first = tl.load(cos_ptr + table, mask=cols < HALF, other=0.0)
    cos_second = tl.load(cos_ptr + table + HALF, mask=cols < HALF, other=0.0)
    sin_first = tl.load(sin_ptr + table, mask=cols < HALF, other=0.0)  # -sin
    sin_second = tl.load(sin_ptr + table + HALF, mask=cols < HALF, other=0.0)  # +sin
    first_ptr = x_ptr + token * token_stride + heads * head_stride + cols
    dtype = x_ptr.dtype.element_ty
    first = tl.load(first_ptr, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(first_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    # As torch: x * cos rounded to x's dtype, then + swapped * signed_sin rounded once.
    scaled_first = (first * cos_first.to(tl.float32)).to(dtype).to(tl.float32)
    scaled_second = (second * cos_second.to(tl.float32)).to(dtype).to(tl.float32)
    new_first = scaled_first + second * sin_first.to(tl.float32)
    new_second = scaled_second + first * sin_second.to(tl.float32)
    tl.store(first_ptr, new_first.to(dtype), mask=mask)
    tl.store(first_ptr + HALF, new_second.to(dtype), mask=mask)


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate `x` [T, heads, head_size] in place by `cos` / `signed_sin` [T, 1, rotary_dim]
    (see the reference); writes `x`."""
    num_tokens, num_heads, head_size = x.shape
    rotary_dim = cos.shape[-1]
    assert rotary_dim % 2 == 0
    assert rotary_dim <= head_size
    assert x.stride(-1) == 1
    assert cos.is_contiguous()
    assert signed_sin.is_contiguous()
    assert cos.shape == signed_sin.shape == (num_tokens, 1, rotary_dim)
    assert cos.dtype == signed_sin.dtype == x.dtype
    if num_tokens == 0:
        return
    block_heads = min(triton.next_power_of_2(num_heads), 16)
    grid = (num_tokens, triton.cdiv(num_heads, block_heads))
    _rotary_kernel[grid](
        x,
        cos,
        signed_sin,
        x.stride(0),
        x.stride(1),
        num_heads,
        HALF=rotary_dim // 2,
        BLOCK_HEADS=block_heads,
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
    )


@triton.jit  # type: ignore[untyped-decorator]
def _silu_and_mul_kernel(out_ptr, x_ptr, x_row_stride, inner, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_row_stride + inner + cols, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    # transformers rounds silu(gate) to the activation dtype before the product.
    activated = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype).to(tl.float32)
    product = activated * up.to(tl.float32)
    tl.store(out_ptr + row * inner + cols, product.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(gate) * up in one launch."""
    inner = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inner)
    assert rows.stride(-1) == 1
    out = torch.empty((rows.shape[0], inner), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inner), 1024)
    if rows.shape[0]:
        grid = (rows.shape[0], triton.cdiv(inner, block))
        _silu_and_mul_kernel[grid](out, rows, rows.stride(0), inner, BLOCK=block)
    return out.view(*x.shape[:-1], inner)


@triton.jit  # type: ignore[untyped-decorator]
def _gated_rms_norm_kernel(  # type: ignore[no-untyped-def]
    out_ptr, x_ptr, gate_ptr, weight_ptr, dim, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    # As torch: the normalised row rounded to x's dtype, times the weight in the weight's dtype.
    scaled = ((x * rstd).to(dtype).to(tl.float32) * weight).to(weight_ptr.dtype.element_ty)
    out = scaled.to(tl.float32) * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + row * dim + cols, out.to(dtype), mask=mask)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """[..., d] -> weight * RMSNorm(x) * silu(gate) in one launch (see the reference)."""
    dim = x.shape[-1]
    assert gate.shape == x.shape
    assert weight.shape == (dim,)
    assert weight.is_contiguous()
    rows, gates = x.contiguous().view(-1, dim), gate.contiguous().view(-1, dim)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _gated_rms_norm_kernel[(rows.shape[0],)](
            out, rows, gates, weight, dim, eps, BLOCK=triton.next_power_of_2(dim)
        )
    return out.view(x.shape)

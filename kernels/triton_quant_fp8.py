"""Triton block-scaled FP8 GEMM (Qwen3 "-FP8", DeepSeek style): y = x W^T.

    quantize: grid (M, cdiv(K, GROUP_K))          program: one token's group -> e4m3 + scale
    gemm:     grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
              program: an output tile; per K-tile (= one scale group, BLOCK_K == bk) it takes
              the e4m3 dot in fp32 and multiplies in the activation scale per row and the
              weight block scale per column before accumulating.

Layouts are those of `kernels.quant_reference` (`weight` e4m3 [N, K], `weight_scale_inv`
float32 [ceil(N/bn), ceil(K/bk)]); the activation is quantized per token per bk channels like
`quant_reference.quantize_fp8_groups`. Needs FP8 tensor cores (sm_89+: Triton has no e4m3
type before); older GPUs run the dequantized weights. The interpreter's
fp32 -> e4m3 cast does not round to nearest (a carry into the exponent halves the value), so
there the values are first rounded to e4m3 in fp32, which makes the cast exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quant_reference import FP8_MAX, FP8_SCALE_EPS


@dataclass(frozen=True)
class Fp8LaunchConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@triton.jit
def _round_to_e4m3(values):  # type: ignore[no-untyped-def]
    """Round fp32 values (|v| <= 448) to the nearest e4m3 value, ties to even, in fp32."""
    exponent = ((values.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exponent = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; subnormals below 2^-6
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)
    steps = values / step  # exact: a power of two, and |steps| < 16
    return ((steps + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: fp32 rounds to integers


@triton.jit  # type: ignore[untyped-decorator]
def _quantize_fp8_groups_kernel(  # type: ignore[no-untyped-def]
    x_ptr, q_ptr, scale_ptr, cols, stride_x, stride_q, stride_scale,
    GROUP_K: tl.constexpr, FP8_LIMIT: tl.constexpr, EPS: tl.constexpr, ROUND_FIRST: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols_here = group * GROUP_K + tl.arange(0, GROUP_K)
    ok = cols_here < cols
    x = tl.load(x_ptr + row * stride_x + cols_here, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), EPS) / FP8_LIMIT
    values = tl.clamp(x / scale, -FP8_LIMIT, FP8_LIMIT)
    if ROUND_FIRST:
        values = _round_to_e4m3(values)
    tl.store(q_ptr + row * stride_q + cols_here, values.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row * stride_scale + group, scale)


@triton.jit  # type: ignore[untyped-decorator]
def _fp8_block_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, c_ptr, M, N, K,
    stride_am, stride_a_scale, stride_bn, stride_b_scale, stride_cm,
    SCALE_ROWS_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + cols[None, :].to(tl.int64) * stride_bn
    a_scales = a_scale_ptr + rows.to(tl.int64) * stride_a_scale
    b_scales = b_scale_ptr + (cols // SCALE_ROWS_N) * stride_b_scale
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        k = k_tile * BLOCK_K + ks
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_scale = tl.load(a_scales + k_tile, mask=row_ok, other=0.0)
        b_scale = tl.load(b_scales + k_tile, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
    out = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def quantize_fp8_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 [M, ceil(K/group)]), as the reference of that name."""
    assert x.dim() == 2, "x is [M, K]"
    assert group & (group - 1) == 0, "the group is a power of two"
    assert group >= 16, "the group is at least 16"
    x = x if x.stride(1) == 1 else x.contiguous()
    rows, cols = x.shape
    groups = triton.cdiv(cols, group)
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_fp8_groups_kernel[(rows, groups)](
            x, values, scales, cols, x.stride(0), values.stride(0), scales.stride(0),
            GROUP_K=group, FP8_LIMIT=FP8_MAX, EPS=FP8_SCALE_EPS,
            ROUND_FIRST=x.device.type != "cuda",
        )  # fmt: skip
    return values, scales


def choose_fp8_launch(num_rows: int) -> Fp8LaunchConfig:
    """Decode batches take thin tiles (more programs over N), prefill square ones."""
    if num_rows <= 16:
        return Fp8LaunchConfig(16, 64, 4, 4)
    if num_rows <= 64:
        return Fp8LaunchConfig(64, 64, 4, 4)
    return Fp8LaunchConfig(128, 128, 8, 3)


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    launch: Fp8LaunchConfig | None = None,
) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) @ W^T, W e4m3 [N, K] with block scales -> [M, N] in x's dtype."""
    block_n, block_k = block
    assert fp8_gemm_supported(x.device), "Triton takes e4m3 operands on sm_89+ only"
    assert weight.dtype == torch.float8_e4m3fn, "the weight is float8_e4m3fn"
    assert weight.dim() == 2, "the weight is [N, K]"
    assert weight.stride(1) == 1, "the weight is row-major"
    assert x.dim() == 2, "x is [M, K]"
    assert x.shape[1] == weight.shape[1], "x and the weight share K"
    num_n, num_k = weight.shape
    grid_shape = (triton.cdiv(num_n, block_n), triton.cdiv(num_k, block_k))
    assert scale_inv.shape == grid_shape, f"weight_scale_inv is {list(grid_shape)}"
    assert scale_inv.dtype == torch.float32, "weight_scale_inv is float32"
    assert scale_inv.stride(1) == 1, "weight_scale_inv is row-major"
    x_q, x_scales = quantize_fp8_groups(x, block_k)
    out = torch.empty(x.shape[0], num_n, dtype=x.dtype, device=x.device)
    launch = launch or choose_fp8_launch(x.shape[0])
    grid = (triton.cdiv(x.shape[0], launch.block_m), triton.cdiv(num_n, launch.block_n))
    if x.shape[0]:
        _fp8_block_gemm_kernel[grid](
            x_q, x_scales, weight, scale_inv, out, x.shape[0], num_n, num_k,
            x_q.stride(0), x_scales.stride(0), weight.stride(0), scale_inv.stride(0),
            out.stride(0), SCALE_ROWS_N=block_n, BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n, BLOCK_K=block_k,
            num_warps=launch.num_warps, num_stages=launch.num_stages,
        )  # fmt: skip
    return out


def fp8_gemm_supported(device: torch.device) -> bool:
    """FP8 tensor cores (sm_89+), or the interpreter on CPU; elsewhere weights are dequantized."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)

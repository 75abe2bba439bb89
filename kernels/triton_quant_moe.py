"""Triton weight-only GEMMs that dequantize in-kernel: MXFP4 and int4 expert (MoE) grouped
GEMMs, and the dense int4 GEMM (W4A16) as the one-expert case.

    grid (cdiv(T, BLOCK_M) + E, cdiv(N, BLOCK_N))
    program: one BLOCK_M tile of one expert's rows x one BLOCK_N slice of its outputs

Tokens come sorted by expert with `expert_offsets` [E + 1]. Expert e owns cdiv(rows_e, BLOCK_M)
row tiles; `tile_ends` (their running sum, computed on the device, so no host sync) maps a
program to its expert, and programs past the last tile return at once. Each K step loads the
packed weight tile [BLOCK_K, BLOCK_N], decodes it to fp32 (e2m1 codes times 2^(s-127), or
(nibble - zero) * scale), and takes the dot in the activation dtype (fp32 under the
interpreter, where bf16 dots are wrong). Layouts are those of `kernels.quant_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quant_reference import INT4_SYMMETRIC_ZERO, MXFP4_BLOCK

MXFP4 = 0
INT4 = 1


@dataclass(frozen=True)
class MoeLaunchConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PackedExperts:
    """Quantized weights [E, N, K] in a canonical layout, viewed as the kernel reads them."""

    kind: int
    """MXFP4 or INT4"""
    packed: torch.Tensor
    """MXFP4: uint8 [E, N, K/2]; INT4: int32 [E, N, ceil(K/8)]"""
    scales: torch.Tensor
    """[E, N, groups]: uint8 e8m0 exponents, or int4 scales in the activation dtype"""
    zeros: torch.Tensor | None
    """uint8 [E, N, groups] int4 zero points, or None"""
    group: int
    out_features: int


@triton.jit  # type: ignore[untyped-decorator]
def _decode_mxfp4(packed_ptr, scale_ptr, k, mask, GROUP: tl.constexpr):  # type: ignore[no-untyped-def]
    """[BLOCK_K, BLOCK_N] fp32 weights^T; `packed_ptr`/`scale_ptr` point at the columns' rows."""
    byte = tl.load(packed_ptr + (k // 2)[:, None], mask=mask, other=0).to(tl.int32)
    code = (byte >> ((k % 2) * 4)[:, None]) & 0xF
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    magnitude = tl.where(
        exponent == 0,
        0.5 * mantissa,
        (1.0 + 0.5 * mantissa) * tl.exp2(exponent.to(tl.float32) - 1.0),
    )
    value = tl.where(code >= 8, -magnitude, magnitude)
    power = tl.load(scale_ptr + (k // GROUP)[:, None], mask=mask, other=127).to(tl.float32)
    return value * tl.exp2(power - 127.0)


@triton.jit  # type: ignore[untyped-decorator]
def _decode_int4(packed_ptr, scale_ptr, zero_ptr, k, mask, GROUP: tl.constexpr,  # type: ignore[no-untyped-def]
                 HAS_ZEROS: tl.constexpr, SYMMETRIC_ZERO: tl.constexpr):  # fmt: skip
    word = tl.load(packed_ptr + (k // 8)[:, None], mask=mask, other=0)
    nibble = ((word >> ((k % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    scale = tl.load(scale_ptr + (k // GROUP)[:, None], mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zero_ptr + (k // GROUP)[:, None], mask=mask, other=0).to(tl.float32)
    else:
        zero = SYMMETRIC_ZERO
    return (nibble - zero) * scale


@triton.jit  # type: ignore[untyped-decorator]
def _weight_only_grouped_kernel(  # type: ignore[no-untyped-def]
    x_ptr, offsets_ptr, tile_ends_ptr, packed_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    num_experts, num_rows, N, K,
    stride_xm, stride_pe, stride_pn, stride_se, stride_sn, stride_be, stride_om,
    KIND: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, SYMMETRIC_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr, SINGLE_EXPERT: tl.constexpr, EXPERTS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    if SINGLE_EXPERT:  # dense: every row is expert 0's, one tile per program
        expert = 0
        row_start = tile * BLOCK_M
        row_end = num_rows
    else:
        experts = tl.arange(0, EXPERTS_POW2)
        ends = tl.load(tile_ends_ptr + experts, mask=experts < num_experts, other=2**30)
        expert = tl.sum((ends <= tile).to(tl.int32), axis=0)
        if expert >= num_experts:
            return
        first_tile = tl.load(tile_ends_ptr + expert - 1, mask=expert > 0, other=0)
        row_end = tl.load(offsets_ptr + expert + 1)
        row_start = tl.load(offsets_ptr + expert) + (tile - first_tile) * BLOCK_M
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    expert_64 = tl.full((), expert, tl.int64)
    packed_cols = packed_ptr + expert_64 * stride_pe + cols[None, :].to(tl.int64) * stride_pn
    scale_cols = scale_ptr + expert_64 * stride_se + cols[None, :].to(tl.int64) * stride_sn
    zero_cols = zero_ptr + expert_64 * stride_se + cols[None, :].to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k = k_start + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        if KIND == 0:
            w = _decode_mxfp4(packed_cols, scale_cols, k, w_mask, GROUP)
        else:
            w = _decode_int4(
                packed_cols, scale_cols, zero_cols, k, w_mask, GROUP, HAS_ZEROS, SYMMETRIC_ZERO
            )
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert_64 * stride_be + cols, mask=col_ok, other=0.0)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor) -> PackedExperts:
    """gpt-oss `*_blocks` uint8 [E, N, K/32, 16] and `*_scales` uint8 [E, N, K/32]."""
    assert blocks.dtype == torch.uint8, "blocks are uint8"
    assert blocks.dim() == 4, "blocks are [E, N, K/32, 16]"
    assert blocks.shape[3] == MXFP4_BLOCK // 2, "blocks are [E, N, K/32, 16]"
    assert scales.dtype == torch.uint8, "scales are uint8 e8m0"
    assert scales.shape == blocks.shape[:3], "scales are [E, N, K/32]"
    packed = blocks.reshape(*blocks.shape[:2], -1)
    assert packed.stride(2) == 1, "weight rows must be contiguous"
    assert scales.stride(2) == 1, "scale rows must be contiguous"
    return PackedExperts(MXFP4, packed, scales, None, MXFP4_BLOCK, blocks.shape[1])


def int4_experts(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int
) -> PackedExperts:
    """Canonical int4: int32 [E, N, ceil(K/8)], scales (and uint8 zeros) [E, N, ceil(K/group)]."""
    assert qweight.dtype == torch.int32, "qweight is int32"
    assert qweight.dim() == 3, "qweight is [E, N, ceil(K/8)]"
    assert scales.dim() == 3, "scales are [E, N, groups]"
    assert scales.shape[:2] == qweight.shape[:2], "one scale row per weight row"
    assert group % 8 == 0, "groups hold whole packed words"
    if zeros is not None:
        assert zeros.dtype == torch.uint8, "zero points are uint8"
        assert zeros.shape == scales.shape, "one zero point per scale"
        assert zeros.stride() == scales.stride(), "zero points are laid out as the scales"
    assert qweight.stride(2) == 1, "weight rows must be contiguous"
    assert scales.stride(2) == 1, "scale rows must be contiguous"
    return PackedExperts(INT4, qweight, scales, zeros, group, qweight.shape[1])


def choose_moe_launch(num_rows: int, num_experts: int) -> MoeLaunchConfig:
    """Row tiles sized to the average rows per expert (decode: 16)."""
    per_expert = num_rows / max(num_experts, 1)
    if per_expert <= 16:
        return MoeLaunchConfig(16, 64, 64, 4, 3)
    if per_expert <= 64:
        return MoeLaunchConfig(64, 64, 64, 4, 3)
    return MoeLaunchConfig(128, 128, 64, 8, 3)


def grouped_weight_only_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor | None,
    experts: PackedExperts,
    bias: torch.Tensor | None = None,
    launch: MoeLaunchConfig | None = None,
) -> torch.Tensor:
    """Tokens sorted by expert x [T, K] -> [T, N] in x's dtype; rows of expert e times its
    dequantized weight^T (+ bias [E, N]). No offsets: one expert owns every row (dense)."""
    num_experts = experts.packed.shape[0]
    assert x.dim() == 2, "x is [T, K]"
    assert x.stride(1) == 1, "x is row-major"
    assert bias is None or (bias.shape == (num_experts, experts.out_features))
    assert bias is None or bias.stride(1) == 1
    num_rows, num_k = x.shape
    launch = launch or choose_moe_launch(num_rows, num_experts)
    out = torch.empty(num_rows, experts.out_features, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    if expert_offsets is None:
        assert num_experts == 1, "without offsets the weight is one expert's"
        tile_ends = expert_offsets = out  # never read
        row_tiles = triton.cdiv(num_rows, launch.block_m)
    else:
        assert expert_offsets.shape == (num_experts + 1,), "expert_offsets is [E + 1]"
        assert expert_offsets.dtype == torch.int32, "expert_offsets is int32"
        assert expert_offsets.device == x.device, "offsets live on x's device"
        tiles = (expert_offsets.diff() + launch.block_m - 1) // launch.block_m
        tile_ends = torch.cumsum(tiles, 0).to(torch.int32)
        row_tiles = triton.cdiv(num_rows, launch.block_m) + num_experts  # a bound: no sync
    grid = (row_tiles, triton.cdiv(experts.out_features, launch.block_n))
    packed, scales = experts.packed, experts.scales
    zeros = experts.zeros if experts.zeros is not None else scales
    _weight_only_grouped_kernel[grid](
        x, expert_offsets, tile_ends, packed, scales, zeros, bias if bias is not None else out,
        out, num_experts, num_rows, experts.out_features, num_k,
        x.stride(0), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        KIND=experts.kind, GROUP=experts.group, HAS_ZEROS=experts.zeros is not None,
        SYMMETRIC_ZERO=INT4_SYMMETRIC_ZERO,
        HAS_BIAS=bias is not None, SINGLE_EXPERT=tile_ends is out,
        EXPERTS_POW2=triton.next_power_of_2(num_experts),
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
        DOT_FP32=x.dtype == torch.float32 or x.device.type != "cuda",
        num_warps=launch.num_warps, num_stages=launch.num_stages,
    )  # fmt: skip
    return out


def mxfp4_moe_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    launch: MoeLaunchConfig | None = None,
) -> torch.Tensor:
    """Same signature and numbers as `quant_reference.mxfp4_moe_gemm`."""
    return grouped_weight_only_gemm(x, expert_offsets, mxfp4_experts(blocks, scales), bias, launch)


def int4_moe_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
    launch: MoeLaunchConfig | None = None,
) -> torch.Tensor:
    """Same signature and numbers as `quant_reference.int4_moe_gemm`."""
    experts = int4_experts(qweight, scales, zeros, group)
    return grouped_weight_only_gemm(x, expert_offsets, experts, bias, launch)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    launch: MoeLaunchConfig | None = None,
) -> torch.Tensor:
    """Dense W4A16 x [M, K] @ W^T (canonical int4 [N, K]): the one-expert grouped GEMM."""
    experts = int4_experts(
        qweight[None], scales[None], None if zeros is None else zeros[None], group
    )
    launch = launch or choose_moe_launch(x.shape[0], 1)
    return grouped_weight_only_gemm(x, None, experts, None, launch)

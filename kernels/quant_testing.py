"""Random quantized weights in the canonical layouts of `kernels.quant_reference`, each with
the float32 weight it stands for, built from the raw codes (not through the reference's
dequantizers), for the kernel tests and the GPU check."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.quant_reference import FP4_VALUES, INT4_SYMMETRIC_ZERO, MXFP4_BLOCK


@dataclass(frozen=True)
class Fp8BlockWeight:
    weight: torch.Tensor
    """float8_e4m3fn [N, K]"""
    scale_inv: torch.Tensor
    """float32 [ceil(N/bn), ceil(K/bk)]"""
    dense: torch.Tensor
    """float32 [N, K]: what it dequantizes to"""


@dataclass(frozen=True)
class Int4Weight:
    qweight: torch.Tensor
    """int32 [..., N, ceil(K/8)]"""
    scales: torch.Tensor
    """[..., N, ceil(K/group)] in the activation dtype"""
    zeros: torch.Tensor | None
    """uint8 [..., N, ceil(K/group)], or None (symmetric)"""
    group: int
    dense: torch.Tensor
    """float32 [..., N, K]"""


@dataclass(frozen=True)
class Mxfp4Weight:
    blocks: torch.Tensor
    """uint8 [E, N, K/32, 16]"""
    scales: torch.Tensor
    """uint8 [E, N, K/32]"""
    dense: torch.Tensor
    """float32 [E, N, K]"""


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_fp8_block_weight(
    rows: int, cols: int, block: tuple[int, int], device: torch.device | str, seed: int = 0
) -> Fp8BlockWeight:
    """e4m3 values of about unit size, block scales spread over two octaves around 1/sqrt(K)."""
    gen = _generator(seed)
    weight = torch.randn(rows, cols, generator=gen).clamp(-6, 6).to(torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.rand(grid, generator=gen).add(0.5) * cols**-0.5
    dense = torch.empty(rows, cols)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = (
                slice(i * block[0], (i + 1) * block[0]),
                slice(j * block[1], (j + 1) * block[1]),
            )
            dense[tile] = weight[tile].float() * scale_inv[i, j]
    return Fp8BlockWeight(weight.to(device), scale_inv.to(device), dense.to(device))


def random_int4_weight(
    shape: tuple[int, ...],
    group: int,
    zero_points: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> Int4Weight:
    """`shape` is [..., N, K]: random nibbles, per-group scales around 1/(4 sqrt(K))."""
    gen = _generator(seed)
    *lead, rows, cols = shape
    groups = -(-cols // group)
    nibbles = torch.randint(0, 16, (*lead, rows, groups * group), generator=gen)
    scales = (torch.rand(*lead, rows, groups, generator=gen) + 0.5) * cols**-0.5 / 4
    scales = scales.to(dtype)
    zeros = torch.randint(0, 16, (*lead, rows, groups), generator=gen) if zero_points else None
    zero = (
        torch.full_like(scales, INT4_SYMMETRIC_ZERO, dtype=torch.int64) if zeros is None else zeros
    )
    grouped = nibbles.view(*lead, rows, groups, group)
    dense = (grouped - zero[..., None]).float() * scales.float()[..., None]
    nibbles = nibbles[..., :cols]
    nibbles = torch.nn.functional.pad(nibbles, (0, -cols % 8)).view(*lead, rows, -1, 8)
    words = torch.zeros(nibbles.shape[:-1], dtype=torch.int64)
    for position in range(8):
        words |= nibbles[..., position] << (4 * position)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return Int4Weight(
        qweight.to(device),
        scales.to(device),
        None if zeros is None else zeros.to(torch.uint8).to(device),
        group,
        dense.flatten(-2)[..., :cols].to(device),
    )


def random_mxfp4_weight(
    experts: int, rows: int, cols: int, device: torch.device | str, seed: int = 0
) -> Mxfp4Weight:
    """Random e2m1 codes, exponents 2^-9 .. 2^-5 (values of about 1/sqrt(K) for K ~ 3k)."""
    assert cols % MXFP4_BLOCK == 0, "MXFP4 rows are whole 32-element blocks"
    gen = _generator(seed)
    codes = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    scales = torch.randint(127 - 9, 127 - 4, (experts, rows, cols // MXFP4_BLOCK), generator=gen)
    values = torch.tensor(FP4_VALUES)[codes]
    dense = values * torch.exp2(scales.float() - 127).repeat_interleave(MXFP4_BLOCK, -1)
    pairs = codes.view(experts, rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    blocks = packed.view(experts, rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2)
    return Mxfp4Weight(blocks.to(device), scales.to(torch.uint8).to(device), dense.to(device))


def expert_offsets(tokens_per_expert: list[int], device: torch.device | str) -> torch.Tensor:
    """int32 [E + 1] row offsets of tokens sorted by expert."""
    bounds = [0]
    for count in tokens_per_expert:
        bounds.append(bounds[-1] + count)
    return torch.tensor(bounds, dtype=torch.int32, device=device)

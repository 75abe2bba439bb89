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


def _generator(device: torch.device | str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def random_fp8_block_weight(
    rows: int, cols: int, block: tuple[int, int], device: torch.device | str, seed: int = 0
) -> Fp8BlockWeight:
    """e4m3 values of about unit size, block scales spread over two octaves around 1/sqrt(K)."""
    gen = _generator(device, seed)
    weight = torch.randn(rows, cols, generator=gen, device=device).clamp(-6, 6)
    weight = weight.to(torch.float8_e4m3fn)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = torch.rand(grid, generator=gen, device=device).add(0.5) * cols**-0.5
    padded = torch.nn.functional.pad(
        weight.float(), (0, grid[1] * block[1] - cols, 0, grid[0] * block[0] - rows)
    )
    tiles = padded.view(grid[0], block[0], grid[1], block[1]) * scale_inv[:, None, :, None]
    dense = tiles.view(padded.shape)[:rows, :cols]
    return Fp8BlockWeight(weight, scale_inv, dense)


def random_int4_weight(
    shape: tuple[int, ...],
    group: int,
    zero_points: bool,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> Int4Weight:
    """`shape` is [..., N, K]: random nibbles, per-group scales around 1/(4 sqrt(K))."""
    gen = _generator(device, seed)
    *lead, rows, cols = shape
    groups = -(-cols // group)

    def randint(size: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(0, 16, size, generator=gen, device=device, dtype=torch.uint8)

    nibbles = randint((*lead, rows, groups * group))
    scales = torch.rand(*lead, rows, groups, generator=gen, device=device)
    scales = ((scales + 0.5) * cols**-0.5 / 4).to(dtype)
    zeros = randint((*lead, rows, groups)) if zero_points else None
    zero = INT4_SYMMETRIC_ZERO if zeros is None else zeros[..., None].float()
    grouped = nibbles.view(*lead, rows, groups, group).float()
    dense = ((grouped - zero) * scales.float()[..., None]).flatten(-2)[..., :cols]
    nibbles = torch.nn.functional.pad(nibbles[..., :cols], (0, -cols % 8))
    nibbles = nibbles.view(*lead, rows, -1, 8).to(torch.int64)
    words = torch.zeros(nibbles.shape[:-1], dtype=torch.int64, device=device)
    for position in range(8):
        words |= nibbles[..., position] << (4 * position)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return Int4Weight(qweight, scales, zeros, group, dense)


def random_mxfp4_weight(
    experts: int, rows: int, cols: int, device: torch.device | str, seed: int = 0
) -> Mxfp4Weight:
    """Random e2m1 codes, exponents 2^-9 .. 2^-5 (values of about 1/sqrt(K) for K ~ 3k)."""
    assert cols % MXFP4_BLOCK == 0, "MXFP4 rows are whole 32-element blocks"
    gen = _generator(device, seed)
    per_row = cols // MXFP4_BLOCK

    def randint(low: int, high: int, size: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(low, high, size, generator=gen, device=device, dtype=torch.uint8)

    codes = randint(0, 16, (experts, rows, cols))
    scales = randint(127 - 9, 127 - 4, (experts, rows, per_row))
    values = torch.tensor(FP4_VALUES, device=device)[codes.long()]
    powers = torch.exp2(scales.float() - 127)
    dense = (values.view(experts, rows, per_row, MXFP4_BLOCK) * powers[..., None]).flatten(-2)
    pairs = codes.view(experts, rows, cols // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    blocks = packed.view(experts, rows, per_row, MXFP4_BLOCK // 2)
    return Mxfp4Weight(blocks, scales, dense)


def expert_offsets(tokens_per_expert: list[int], device: torch.device | str) -> torch.Tensor:
    """int32 [E + 1] row offsets of tokens sorted by expert."""
    bounds = [0]
    for count in tokens_per_expert:
        bounds.append(bounds[-1] + count)
    return torch.tensor(bounds, dtype=torch.int32, device=device)

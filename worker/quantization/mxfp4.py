"""MXFP4 checkpoints (`quant_method: mxfp4`, gpt-oss): the experts' weights in OCP microscaling
FP4, everything else (attention, router, biases, embeddings: `modules_to_not_convert`) plain.

A quantized tensor `P` (`mlp.experts.gate_up_proj` / `down_proj`) is stored as two parts:
`P_blocks`, uint8 [E, N, K/32, 16] holding two e2m1 codes per byte (low nibble first), and
`P_scales`, uint8 [E, N, K/32], one e8m0 exponent per 32 values (value 2^(s - 127)). Rows are
output features; the model's parameter is [E, K, N] (transformers' `GptOssExperts`: inputs
first), so the dequantized [E, N, K] is transposed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from worker.quantization.scheme import check_shape, require

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
VALUES_PER_BLOCK = 32
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The eight magnitudes of an e2m1 code's low three bits; bit 3 is the sign."""

_PACKED_DTYPE_NAMES = ("U8", "I8")


class Mxfp4Scheme:
    """Dequantizes MXFP4 `_blocks` / `_scales` pairs to the [E, K, N] expert parameters."""

    method = "mxfp4"

    def __init__(self, quant_config: Mapping[str, Any]) -> None:
        """`quant_config` names no options that change how parts are read."""

    def part_of(self, name: str) -> tuple[str, str] | None:
        for suffix, role in ((BLOCKS_SUFFIX, "blocks"), (SCALES_SUFFIX, "scales")):
            if name.endswith(suffix):
                return name.removesuffix(suffix), role
        return None

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        blocks, scales = require(logical, parts, "blocks", "scales")
        if blocks.dim() < 2 or blocks.shape[-1] != VALUES_PER_BLOCK // 2:
            raise ValueError(
                f"quantized checkpoint tensor {logical}{BLOCKS_SUFFIX} has shape "
                f"{tuple(blocks.shape)}, expected [..., K/32, 16] (32 e2m1 values per block)"
            )
        check_shape(
            f"{logical}{SCALES_SUFFIX}",
            scales,
            tuple(blocks.shape[:-1]),
            f"one exponent per 32 values of {logical}{BLOCKS_SUFFIX} {tuple(blocks.shape)}",
        )
        values = unpack_e2m1(blocks.view(torch.uint8))
        exponents = scales.view(torch.uint8).to(torch.int32) - E8M0_BIAS
        scaled = torch.ldexp(values, exponents.unsqueeze(-1))
        rows = scaled.flatten(-2)  # [..., N, K]
        return rows.transpose(-1, -2).contiguous()

    def check_plain(self, name: str, dtype_name: str) -> None:
        if dtype_name in _PACKED_DTYPE_NAMES:
            raise ValueError(
                f"checkpoint tensor {name} is {dtype_name} but is not an mxfp4 "
                f"{BLOCKS_SUFFIX.lstrip('_')} / {SCALES_SUFFIX.lstrip('_')} pair"
            )


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] of two e2m1 codes each (low nibble first) -> float32 [..., 2B]."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    table = torch.cat([magnitudes, -magnitudes])
    low = table[(packed & 0x0F).long()]
    high = table[(packed >> 4).long()]
    return torch.stack([low, high], dim=-1).flatten(-2)

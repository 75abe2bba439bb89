"""FP8 checkpoints (`quant_method: fp8`): float8_e4m3fn weights with float32 scales.

Block-wise (Qwen3 / Qwen3-Next / Qwen3.5 `-FP8`, DeepSeek style): `weight_block_size` [bn, bk]
and `X.weight_scale_inv` [ceil(N/bn), ceil(K/bk)], one scale per block, multiplied in to
dequantize. Per-tensor (no `weight_block_size`): `X.weight_scale` (a scalar or [1]), and
`X.input_scale` for static activation quantization, unused when computing in 16 bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from worker.quantization.scheme import WEIGHT_ROLE, check_shape, expand_blocks, require

BLOCK_SCALE_SUFFIX = ".weight_scale_inv"
TENSOR_SCALE_SUFFIX = ".weight_scale"
INPUT_SCALE_SUFFIX = ".input_scale"
FP8_DTYPE_NAMES = ("F8_E4M3", "F8_E5M2")


class Fp8Scheme:
    """Dequantizes fp8 weights with block or per-tensor scales."""

    method = "fp8"

    def __init__(self, quant_config: Mapping[str, Any]) -> None:
        block = quant_config.get("weight_block_size")
        self.block: tuple[int, int] | None = None
        if block is not None:
            if len(block) != 2 or min(int(size) for size in block) < 1:
                raise ValueError(f"fp8 weight_block_size must be [rows, cols], got {block}")
            self.block = (int(block[0]), int(block[1]))

    def part_of(self, name: str) -> tuple[str, str] | None:
        for suffix, role in (
            (BLOCK_SCALE_SUFFIX, "scale"),
            (TENSOR_SCALE_SUFFIX, "scale"),
            (INPUT_SCALE_SUFFIX, "input_scale"),
        ):
            if name.endswith(suffix):
                return name.removesuffix(suffix) + ".weight", role
        return None

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        weight, scale = require(logical, parts, WEIGHT_ROLE, "scale")
        values = weight.to(torch.float32)
        scale = scale.to(torch.float32)
        if self.block is None:
            check_shape(f"{logical}_scale", scale.reshape(-1), (1,), "one per-tensor scale")
            return values * scale.reshape(())
        rows, cols = self.block
        expected = (
            *weight.shape[:-2],
            -(-weight.shape[-2] // rows),
            -(-weight.shape[-1] // cols),
        )
        check_shape(
            f"{logical}_scale_inv",
            scale,
            expected,
            f"{rows}x{cols} blocks of {tuple(weight.shape)}",
        )
        return values * expand_blocks(scale, self.block, weight.shape)

    def check_plain(self, name: str, dtype_name: str) -> None:
        if dtype_name in FP8_DTYPE_NAMES:
            raise ValueError(
                f"checkpoint tensor {name} is {dtype_name} but has no "
                f"{BLOCK_SCALE_SUFFIX.lstrip('.')} / {TENSOR_SCALE_SUFFIX.lstrip('.')}"
            )

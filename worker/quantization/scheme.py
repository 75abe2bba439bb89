"""What a quantization format tells the loader: which checkpoint tensors are parts of one
quantized tensor, and how to turn the parts back into the tensor the model expects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

WEIGHT_ROLE = "weight"
"""Role of the part stored under the logical tensor's own name (an fp8 `X.weight`)."""


class WeightScheme(Protocol):
    """One quantization format (a `methods.SUPPORTED_METHODS` entry with its config)."""

    method: str

    def part_of(self, name: str) -> tuple[str, str] | None:
        """`(logical tensor name, role)` when checkpoint tensor `name` is a part of a quantized
        tensor stored under another name (scales, packed values, zero points); None otherwise.
        A part stored under the logical name itself is found by the loader (`WEIGHT_ROLE`)."""

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The tensor `logical` in float32, shaped as in an unquantized checkpoint (same name,
        same layout), from its parts by role. ValueError (one line naming the tensor) for a
        missing or misshapen part."""

    def check_plain(self, name: str, dtype_name: str) -> None:
        """Raise ValueError when a tensor left as it is (no parts found for it) is stored in
        a quantized dtype: its scales are missing. `dtype_name` is safetensors' (e.g. F8_E4M3)."""


def require(logical: str, parts: Mapping[str, torch.Tensor], *roles: str) -> list[torch.Tensor]:
    """The parts of `roles`, or a ValueError naming the first one the checkpoint lacks."""
    missing = [role for role in roles if role not in parts]
    if missing:
        raise ValueError(
            f"quantized checkpoint tensor {logical} has no {missing[0]} (found: "
            f"{', '.join(sorted(parts)) or 'nothing'})"
        )
    return [parts[role] for role in roles]


def check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], why: str) -> None:
    """One-line ValueError when a part's shape is not `expected`."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"quantized checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
            f"{tuple(expected)} ({why})"
        )


def expand_blocks(scales: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Per-block scales [..., ceil(N/bn), ceil(K/bk)] repeated to one per element [..., N, K]."""
    rows, cols = block
    full = scales.repeat_interleave(rows, dim=-2).repeat_interleave(cols, dim=-1)
    return full[..., : shape[-2], : shape[-1]]

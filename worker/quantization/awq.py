"""AWQ checkpoints (`quant_method: awq`, AutoAWQ's `version: gemm`): int4 weights with group
scales and zero points.

Per linear layer X, with K input and N output features and G = K / group_size groups:
`X.qweight` int32 [K, N/8] and `X.qzeros` int32 [G, N/8], both packed along the output
dimension in AWQ's interleaved order (`int4.AWQ_ORDER`), and `X.scales` [G, N] (fp16).
weight = (code - zero) * scale, transposed to [N, K]. Other versions (gemv, gemv_fast,
exllama, marlin) pack differently and are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from worker.quantization import int4
from worker.quantization.scheme import require

SUFFIX_ROLES = {".qweight": "qweight", ".qzeros": "qzeros", ".scales": "scales"}
SUPPORTED_VERSIONS = ("gemm",)


def suffix_part(name: str, suffix_roles: Mapping[str, str]) -> tuple[str, str] | None:
    """`(X.weight, role)` when `name` is `X` + one of the suffixes (int4 layer parts)."""
    for suffix, role in suffix_roles.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight", role
    return None


def int4_bits(method: str, quant_config: Mapping[str, Any]) -> None:
    """ValueError unless the config says 4 bits."""
    bits = quant_config.get("bits")
    if bits != int4.BITS:
        raise ValueError(f"{method} checkpoints with bits={bits!r} are not supported (only 4)")


def group_size_of(method: str, quant_config: Mapping[str, Any]) -> int:
    """The config's group_size (-1: one group per output row)."""
    size = quant_config.get("group_size")
    if not isinstance(size, int) or not (size == -1 or size > 0):
        raise ValueError(f"{method} quantization_config has an invalid group_size {size!r}")
    return size


class AwqScheme:
    """Dequantizes AutoAWQ gemm-packed int4 layers."""

    method = "awq"

    def __init__(self, quant_config: Mapping[str, Any]) -> None:
        int4_bits("awq", quant_config)
        self.group_size = group_size_of("awq", quant_config)
        version = str(quant_config.get("version", "gemm")).lower()
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"awq version {version!r} is not supported (only gemm)")
        if quant_config.get("zero_point", True) is not True:
            raise ValueError("awq checkpoints without zero points are not supported")

    def part_of(self, name: str) -> tuple[str, str] | None:
        return suffix_part(name, SUFFIX_ROLES)

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        qweight, qzeros, scales = require(logical, parts, "qweight", "qzeros", "scales")
        codes = int4.unpack_codes(qweight, 1, int4.AWQ_ORDER, name=f"{logical} qweight")
        zeros = int4.unpack_codes(qzeros, 1, int4.AWQ_ORDER, name=f"{logical} qzeros")
        groups = int4.group_index(codes.shape[0], self.group_size, None, logical)
        return int4.dequantize(codes.T, scales.T, zeros.T, groups, logical)

    def check_plain(self, name: str, dtype_name: str) -> None:
        """Nothing to check: int4 parts never share a name with a plain tensor."""

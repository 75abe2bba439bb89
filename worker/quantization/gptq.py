"""GPTQ checkpoints (`quant_method: gptq`: AutoGPTQ, GPTQModel, optimum): int4 weights with
group scales, zero points and each input column's group.

Per linear layer X, with K input and N output features and G groups: `X.qweight` int32
[K/8, N] packed along the input dimension, `X.qzeros` int32 [G, N/8] packed along the output
dimension (both codes in order), `X.scales` [G, N] (fp16) and `X.g_idx` int32 [K], the group
of each input column (shuffled when quantized in activation order, `desc_act: true`).
`checkpoint_format: gptq` (v1, the default) stores each zero point minus one, `gptq_v2` as it
is. weight = (code - zero) * scale[g_idx], transposed to [N, K]. Symmetric checkpoints store
their zero points (8) as well, so `sym` needs no case of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from worker.quantization import int4
from worker.quantization.awq import group_size_of, int4_bits, suffix_part
from worker.quantization.scheme import require

SUFFIX_ROLES = {".qweight": "qweight", ".qzeros": "qzeros", ".scales": "scales", ".g_idx": "g_idx"}
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
"""What is added to a stored zero point, by checkpoint_format."""


class GptqScheme:
    """Dequantizes GPTQ int4 layers (v1 and v2 zero points, in order or in activation order)."""

    method = "gptq"

    def __init__(self, quant_config: Mapping[str, Any]) -> None:
        int4_bits("gptq", quant_config)
        self.group_size = group_size_of("gptq", quant_config)
        if quant_config.get("is_marlin_format"):
            raise ValueError("gptq checkpoints in marlin format are not supported")
        layout = str(quant_config.get("checkpoint_format", "gptq")).lower()
        if layout not in ZERO_OFFSETS:
            raise ValueError(
                f"gptq checkpoint_format {layout!r} is not supported (gptq or gptq_v2)"
            )
        self.zero_offset = ZERO_OFFSETS[layout]
        self.desc_act = bool(quant_config.get("desc_act", False))

    def part_of(self, name: str) -> tuple[str, str] | None:
        return suffix_part(name, SUFFIX_ROLES)

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        qweight, qzeros, scales = require(logical, parts, "qweight", "qzeros", "scales")
        if self.desc_act:
            require(logical, parts, "g_idx")
        codes = int4.unpack_codes(qweight, 0, name=f"{logical} qweight")
        zeros = int4.unpack_codes(qzeros, 1, name=f"{logical} qzeros") + self.zero_offset
        groups = int4.group_index(codes.shape[0], self.group_size, parts.get("g_idx"), logical)
        return int4.dequantize(codes.T, scales.T, zeros.T, groups, logical)

    def check_plain(self, name: str, dtype_name: str) -> None:
        """Nothing to check: int4 parts never share a name with a plain tensor."""

"""Int4 weights with group scales: the one place that unpacks them (AWQ, GPTQ and
compressed-tensors `pack-quantized` all come here).

Every int4 format stores eight 4-bit codes per int32, code `i` in bits `4i .. 4i+3`, along one
dimension of the weight; formats differ only in that dimension, in which element of the eight
each code holds (AWQ interleaves them, the others keep them in order), and in how a zero point
is stored. This module unpacks to unsigned codes 0..15 and dequantizes in the unquantized
checkpoint's layout, [out_features, in_features]:

    weight[n, k] = (code[n, k] - zero[n, group[k]]) * scale[n, group[k]]

where `group[k]` is input column k's group: `k // group_size`, or the checkpoint's `g_idx` when
quantization went in activation order (GPTQ `desc_act`, compressed-tensors `actorder: group`).
A signed format (compressed-tensors stores code + 8) is the same formula with both codes and
zero points offset alike, so it is dequantized from the unsigned codes directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from worker.quantization.scheme import check_shape, require

BITS = 4
CODES_PER_INT32 = 32 // BITS
CODE_MASK = (1 << BITS) - 1
SIGNED_OFFSET = 1 << (BITS - 1)
"""What a symmetric format's codes are centred on (the zero point of unsigned codes)."""

IN_ORDER = tuple(range(CODES_PER_INT32))
"""Code i of an int32 is element i of its eight (GPTQ, compressed-tensors)."""
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ (gemm): code i of an int32 is element AWQ_ORDER[i] of its eight."""


def unpack_codes(
    packed: torch.Tensor,
    dim: int,
    order: Sequence[int] = IN_ORDER,
    length: int | None = None,
    name: str = "int4 tensor",
) -> torch.Tensor:
    """Unsigned codes (int32, 0..15) of a 2-D int32 tensor packed along `dim` (0 or 1), that
    dimension eight times longer, cut to `length` when the packer padded it."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(
            f"quantized checkpoint tensor {name} must be a 2-D int32 tensor of packed int4 "
            f"codes, got {packed.dim()}-D {str(packed.dtype).removeprefix('torch.')}"
        )
    shifts = torch.arange(CODES_PER_INT32, dtype=torch.int32) * BITS
    codes = (packed.unsqueeze(-1) >> shifts) & CODE_MASK  # [..., code i]
    element_to_code = sorted(range(CODES_PER_INT32), key=lambda code: order[code])
    codes = codes[..., element_to_code]  # [..., element j]
    if dim == 0:
        codes = codes.transpose(1, 2)  # [rows / 8, element, cols]
    codes = codes.flatten(dim, dim + 1)
    if length is not None:
        if not codes.shape[dim] - CODES_PER_INT32 < length <= codes.shape[dim]:
            raise ValueError(
                f"quantized checkpoint tensor {name} packs {codes.shape[dim]} codes along "
                f"dimension {dim}, which does not hold {length}"
            )
        codes = codes.narrow(dim, 0, length)
    return codes


def group_index(
    in_features: int, group_size: int, g_idx: torch.Tensor | None, name: str
) -> torch.Tensor:
    """Each input column's group: the checkpoint's `g_idx`, or consecutive groups of
    `group_size` (-1: one group of every column)."""
    if g_idx is not None:
        check_shape(f"{name} g_idx", g_idx, (in_features,), "one group per input column")
        return g_idx.to(torch.long)
    size = in_features if group_size == -1 else group_size
    if size < 1:
        raise ValueError(f"quantized checkpoint tensor {name}: group_size {group_size} is invalid")
    return torch.arange(in_features) // size


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    groups: torch.Tensor,
    name: str,
) -> torch.Tensor:
    """float32 [N, K] from unsigned codes [N, K], scales [N, G], zero points [N, G] (None:
    symmetric, zero point `SIGNED_OFFSET`) and each input column's group [K]."""
    rows, cols = codes.shape
    num_groups = scales.shape[-1] if scales.dim() == 2 else 0
    check_shape(f"{name} scales", scales, (rows, num_groups), f"{rows} rows of group scales")
    if zeros is not None:
        check_shape(f"{name} zero points", zeros, (rows, num_groups), "one per group scale")
    if cols and not 0 <= int(groups.min()) <= int(groups.max()) < num_groups:
        raise ValueError(
            f"quantized checkpoint tensor {name}: input columns name groups "
            f"{int(groups.min())}..{int(groups.max())} but there are {num_groups} scales a row"
        )
    zero = (
        torch.full((), float(SIGNED_OFFSET))
        if zeros is None
        else zeros[:, groups].to(torch.float32)
    )
    values: torch.Tensor = (codes.to(torch.float32) - zero) * scales[:, groups].to(torch.float32)
    return values


@dataclass(frozen=True)
class PackedInt4Args:
    """compressed-tensors `pack-quantized` int4 weights: a config group's `weights` entry."""

    group_size: int
    """-1 for `strategy: channel` (one scale per output row)."""
    symmetric: bool
    activation_order: bool
    """`actorder: group`: the checkpoint stores each input column's group (`weight_g_idx`)."""

    @classmethod
    def from_config(cls, group: str, weights: Mapping[str, Any]) -> PackedInt4Args:
        """The arguments of config group `group`'s `weights`; ValueError (one line) for
        weights that are not int4 with group or channel scales."""
        kind, bits = weights.get("type"), weights.get("num_bits")
        strategy = weights.get("strategy")
        if kind != "int" or bits != BITS or strategy not in ("group", "channel"):
            raise ValueError(
                f"compressed-tensors config group {group}: pack-quantized {kind}{bits} weights "
                f"with strategy {strategy!r} are not supported (int4, group or channel)"
            )
        if weights.get("dynamic"):
            raise ValueError(f"compressed-tensors config group {group}: weights are dynamic")
        group_size = int(weights.get("group_size") or 0) if strategy == "group" else -1
        if strategy == "group" and group_size < 1:
            raise ValueError(
                f"compressed-tensors config group {group}: strategy group needs a group_size"
            )
        return cls(group_size, bool(weights.get("symmetric", True)), _orders_groups(weights))

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)


def _orders_groups(weights: Mapping[str, Any]) -> bool:
    """Whether `actorder` shuffles groups (True/"group"); "weight" and "static" keep them."""
    actorder = weights.get("actorder")
    return actorder is True or str(actorder).lower() == "group"


PACKED_ROLES = {
    ".weight_packed": "weight_packed",
    ".weight_scale": "weight_scale",
    ".weight_zero_point": "weight_zero_point",
    ".weight_shape": "weight_shape",
    ".weight_g_idx": "weight_g_idx",
}
"""compressed-tensors `pack-quantized` parts of X.weight, by suffix of X."""


def dequantize_packed(
    logical: str, parts: Mapping[str, torch.Tensor], args: PackedInt4Args
) -> torch.Tensor:
    """float32 [N, K] from `weight_packed` [N, ceil(K/8)] (codes along the input dimension),
    `weight_shape` [N, K], `weight_scale` [N, G], `weight_zero_point` [ceil(N/8), G] (packed
    along the output dimension; asymmetric only) and `weight_g_idx` [K] (actorder group)."""
    packed, shape, scales = require(logical, parts, "weight_packed", "weight_shape", "weight_scale")
    check_shape(f"{logical}_shape", shape.reshape(-1), (2,), "[out_features, in_features]")
    rows, cols = (int(size) for size in shape.reshape(-1).tolist())
    codes = unpack_codes(packed, 1, length=cols, name=f"{logical}_packed")
    check_shape(f"{logical}_packed", codes, (rows, cols), f"weight_shape {[rows, cols]}")
    zeros = None
    if not args.symmetric:
        (packed_zeros,) = require(logical, parts, "weight_zero_point")
        zeros = unpack_codes(packed_zeros, 0, length=rows, name=f"{logical}_zero_point")
    g_idx = require(logical, parts, "weight_g_idx")[0] if args.activation_order else None
    groups = group_index(cols, args.group_size, g_idx, logical)
    return dequantize(codes, scales, zeros, groups, logical)


class PackedInt4Group:
    """A compressed-tensors config group of int4 weights stored `pack-quantized` (W4A16):
    a `compressed_tensors.GroupScheme`."""

    part_suffixes: Mapping[str, str] = PACKED_ROLES

    def __init__(self, group: str, weights: Mapping[str, Any]) -> None:
        self.args = PackedInt4Args.from_config(group, weights)

    def accepts(self, parts: Mapping[str, torch.Tensor]) -> bool:
        """Packed int4 parts whose scales have this group's number of groups a row."""
        if "weight_packed" not in parts:
            return False
        shape, scales = parts.get("weight_shape"), parts.get("weight_scale")
        if shape is None or scales is None or shape.numel() != 2 or scales.dim() != 2:
            return True  # dequantize names what is missing or misshapen
        return scales.shape[1] == self.args.num_groups(int(shape.reshape(-1)[1]))

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_packed(logical, parts, self.args)

    def check_plain(self, name: str, dtype_name: str) -> None:
        """Nothing to check: packed parts never share a name with a plain tensor."""

"""A quantized checkpoint tensor's parts in the layouts the GPU kernels read (those of
`kernels.quant_reference`), with the tensor-parallel cuts of each.

`kernel_weight(source)` turns one `DequantizedWeight` (parts still as stored) into:

- `Fp8BlockLayout`: e4m3 [N, K] and float32 scales [N, ceil(K/bk)], one per row and K block
  (block rows repeated, so output rows cut and concatenate at any row);
- `Fp8ChannelLayout`: e4m3 [N, K], float32 scale [1] (per tensor) or [N], static input scale;
- `Int4Layout`: int32 [N, ceil(K/8)] nibbles along K, scales [N, G] as stored, uint8 zero
  points [N, G] or None (symmetric, 8). AWQ and GPTQ are unpacked and repacked once;
- `Mxfp4Layout`: gpt-oss's `_blocks` [E, N, K/32, 16] and `_scales` [E, N, K/32] as stored;

or a one-line reason it has none (activation-order groups, e5m2 weights, odd groups).
`rows` cuts output features (column-parallel, any range); `cols` cuts input features
(row-parallel) and gives a reason instead when the range does not start on a K block, int4
group or packed word. `dequantize` is the float32 weight in the unquantized checkpoint's layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, Union

import torch

from kernels import quant_reference
from worker.quantization import int4
from worker.quantization.checkpoint import DequantizedWeight
from worker.quantization.compressed_tensors import CompressedTensorsScheme, Fp8Group
from worker.quantization.int4 import PackedInt4Group

MXFP4_BLOCK = quant_reference.MXFP4_BLOCK


class KernelLayout(Protocol):
    """One weight's parts in a kernel layout ([N, K] for linear layers, [E, N, K] experts)."""

    kind: str

    def rows(self, start: int, length: int) -> KernelLayout: ...

    def cols(self, start: int, length: int) -> KernelLayout | str: ...

    def dequantize(self) -> torch.Tensor: ...


@dataclass(frozen=True)
class Fp8BlockLayout:
    weight: torch.Tensor
    scales: torch.Tensor
    block_k: int
    kind: str = "fp8-block"

    def rows(self, start: int, length: int) -> Fp8BlockLayout:
        return replace(
            self, weight=_rows(self.weight, start, length), scales=_rows(self.scales, start, length)
        )

    def cols(self, start: int, length: int) -> Fp8BlockLayout | str:
        if start % self.block_k or (
            start + length < self.weight.shape[1] and length % self.block_k
        ):
            return f"input features {start}..{start + length} cut a {self.block_k}-wide FP8 block"
        blocks = slice(start // self.block_k, -(-(start + length) // self.block_k))
        return replace(
            self,
            weight=self.weight[:, start : start + length].contiguous(),
            scales=self.scales[:, blocks].contiguous(),
        )

    def dequantize(self) -> torch.Tensor:
        return quant_reference.dequantize_fp8_block(self.weight, self.scales, (1, self.block_k))


@dataclass(frozen=True)
class Fp8ChannelLayout:
    weight: torch.Tensor
    scale: torch.Tensor
    """float32 [1] (per tensor) or [N]"""
    input_scale: torch.Tensor | None
    kind: str = "fp8-channel"

    def rows(self, start: int, length: int) -> Fp8ChannelLayout:
        scale = self.scale if self.scale.numel() == 1 else _rows(self.scale, start, length)
        return replace(self, weight=_rows(self.weight, start, length), scale=scale)

    def cols(self, start: int, length: int) -> Fp8ChannelLayout:
        return replace(self, weight=self.weight[:, start : start + length].contiguous())

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale.float().reshape(-1, 1)


@dataclass(frozen=True)
class Int4Layout:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group: int
    in_features: int
    kind: str = "int4"

    def rows(self, start: int, length: int) -> Int4Layout:
        zeros = None if self.zeros is None else _rows(self.zeros, start, length)
        return replace(
            self,
            qweight=_rows(self.qweight, start, length),
            scales=_rows(self.scales, start, length),
            zeros=zeros,
        )

    def cols(self, start: int, length: int) -> Int4Layout | str:
        whole_groups = self.scales.shape[1] > 1
        step = self.group if whole_groups else int4.CODES_PER_INT32
        ends_inside = start + length < self.in_features
        if start % step or (ends_inside and length % step):
            return f"input features {start}..{start + length} cut an int4 group of {step}"
        words = slice(start // 8, -(-(start + length) // 8))
        groups = slice(start // self.group, -(-(start + length) // self.group))
        if not whole_groups:
            groups = slice(0, 1)
        zeros = None if self.zeros is None else self.zeros[:, groups].contiguous()
        return replace(
            self,
            qweight=self.qweight[:, words].contiguous(),
            scales=self.scales[:, groups].contiguous(),
            zeros=zeros,
            in_features=length,
        )

    def dequantize(self) -> torch.Tensor:
        return quant_reference.dequantize_int4(
            self.qweight, self.scales, self.zeros, self.group, self.in_features
        )


@dataclass(frozen=True)
class Mxfp4Layout:
    blocks: torch.Tensor
    scales: torch.Tensor
    kind: str = "mxfp4"

    def rows(self, start: int, length: int) -> Mxfp4Layout:
        return replace(
            self,
            blocks=self.blocks[:, start : start + length].contiguous(),
            scales=self.scales[:, start : start + length].contiguous(),
        )

    def cols(self, start: int, length: int) -> Mxfp4Layout | str:
        if start % MXFP4_BLOCK or length % MXFP4_BLOCK:
            return f"input features {start}..{start + length} cut a {MXFP4_BLOCK}-value MXFP4 block"
        blocks = slice(start // MXFP4_BLOCK, (start + length) // MXFP4_BLOCK)
        return replace(
            self,
            blocks=self.blocks[:, :, blocks].contiguous(),
            scales=self.scales[:, :, blocks].contiguous(),
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [E, K, N] (the model's expert parameter: inputs first)."""
        return quant_reference.dequantize_mxfp4(self.blocks, self.scales).transpose(-1, -2)


AnyLayout = Union[Fp8BlockLayout, Fp8ChannelLayout, Int4Layout, Mxfp4Layout]  # noqa: UP007


def _rows(tensor: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return tensor[start : start + length].contiguous()


def kernel_weight(source: DequantizedWeight) -> AnyLayout | str:
    """`source`'s parts in a kernel layout, or why it has none."""
    parts = {role: part.read_all() for role, part in source.parts.items()}
    method = source.scheme.method
    if method == "fp8":
        block = getattr(source.scheme, "block", None)
        return _fp8(parts, "scale", block)
    if method == "mxfp4":
        return Mxfp4Layout(parts["blocks"].view(torch.uint8), parts["scales"].view(torch.uint8))
    if method == "awq":
        return _awq(parts, int(getattr(source.scheme, "group_size", 0)))
    if method == "gptq":
        scheme = source.scheme
        return _gptq(parts, int(getattr(scheme, "group_size", 0)), int(scheme.zero_offset))  # type: ignore[attr-defined]
    if isinstance(source.scheme, CompressedTensorsScheme):
        group = source.scheme.group_for(source.logical, parts)
        if isinstance(group, Fp8Group):
            return _fp8(parts, "weight_scale", group.block if group.strategy == "block" else None)
        if isinstance(group, PackedInt4Group):
            return _packed_int4(parts, group)
    return f"{method} weights have no kernel"


def _fp8(
    parts: Mapping[str, torch.Tensor], scale_role: str, block: tuple[int, int] | None
) -> AnyLayout | str:
    weight, scale = parts["weight"], parts[scale_role].float()
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        return f"{str(weight.dtype).removeprefix('torch.')} weights have no FP8 kernel (e4m3 only)"
    if block is None:
        input_scale = parts.get("input_scale")
        scale = scale.reshape(-1)
        if scale.numel() not in (1, weight.shape[0]):
            return "FP8 scales are neither per tensor nor per output channel"
        static = None if input_scale is None else input_scale.float().reshape(1)
        return Fp8ChannelLayout(weight.contiguous(), scale.contiguous(), static)
    rows, cols = block
    if cols < 16 or cols & (cols - 1):
        return f"FP8 blocks {rows}x{cols}: the kernel takes K blocks of a power of two >= 16"
    per_row = scale.repeat_interleave(rows, dim=0)[: weight.shape[0]]
    return Fp8BlockLayout(weight.contiguous(), per_row.contiguous(), cols)


def _in_order(g_idx: torch.Tensor | None, in_features: int, group_size: int) -> bool:
    if g_idx is None:
        return True
    expected = int4.group_index(in_features, group_size, None, "g_idx")
    return torch.equal(g_idx.to(torch.long).reshape(-1), expected)


def _int4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None,
) -> Int4Layout | str:
    """From unsigned codes [N, K], scales [N, G] and zero points [N, G] (or None)."""
    in_features = codes.shape[1]
    if not _in_order(g_idx, in_features, group_size):
        return "activation-order groups (g_idx) have no int4 kernel"
    group = -(-in_features // 8) * 8 if group_size == -1 else group_size
    if group % int4.CODES_PER_INT32:
        return f"int4 groups of {group_size} do not hold whole packed words"
    qweight = quant_reference.pack_int4(codes.to(torch.uint8))
    zero_points = None if zeros is None else zeros.to(torch.uint8).contiguous()
    return Int4Layout(qweight, scales.contiguous(), zero_points, group, in_features)


def _awq(parts: Mapping[str, torch.Tensor], group_size: int) -> Int4Layout | str:
    codes = int4.unpack_codes(parts["qweight"], 1, int4.AWQ_ORDER).T
    zeros = int4.unpack_codes(parts["qzeros"], 1, int4.AWQ_ORDER)[:, : codes.shape[0]].T
    return _int4(codes, parts["scales"].T, zeros, group_size, None)


def _gptq(parts: Mapping[str, torch.Tensor], group_size: int, zero_offset: int) -> Int4Layout | str:
    codes = int4.unpack_codes(parts["qweight"], 0).T
    zeros = int4.unpack_codes(parts["qzeros"], 1)[:, : codes.shape[0]] + zero_offset
    return _int4(codes, parts["scales"].T, zeros.T, group_size, parts.get("g_idx"))


def _packed_int4(parts: Mapping[str, torch.Tensor], group: PackedInt4Group) -> Int4Layout | str:
    rows, cols = (int(size) for size in parts["weight_shape"].reshape(-1).tolist())
    codes = int4.unpack_codes(parts["weight_packed"], 1, length=cols)
    zeros = None
    if not group.args.symmetric:
        zeros = int4.unpack_codes(parts["weight_zero_point"], 0, length=rows)
    g_idx = parts.get("weight_g_idx") if group.args.activation_order else None
    return _int4(codes, parts["weight_scale"], zeros, group.args.group_size, g_idx)


def concatenate_rows(layouts: Sequence[AnyLayout]) -> AnyLayout | str:
    """One layout of the layouts' rows in order (a packed layer's shards), or why not."""
    first = layouts[0]
    if len(layouts) == 1:
        return first
    if any(type(layout) is not type(first) for layout in layouts):
        return "its shards are stored in different formats"
    if isinstance(first, Fp8BlockLayout):
        blocks = {layout.block_k for layout in layouts}  # type: ignore[union-attr]
        if len(blocks) > 1:
            return "its shards have different FP8 blocks"
        return replace(
            first,
            weight=torch.cat([layout.weight for layout in layouts]),  # type: ignore[union-attr]
            scales=torch.cat([layout.scales for layout in layouts]),  # type: ignore[union-attr]
        )
    if isinstance(first, Fp8ChannelLayout):
        return _concatenate_fp8_channel(layouts)  # type: ignore[arg-type]
    if isinstance(first, Int4Layout):
        return _concatenate_int4(layouts)  # type: ignore[arg-type]
    return "its shards cannot be concatenated"


def _concatenate_fp8_channel(layouts: Sequence[Fp8ChannelLayout]) -> Fp8ChannelLayout:
    """Per-tensor scales that differ become per-row ones; the static input scale is the
    largest of the shards' (none when a shard quantizes activations per token)."""
    scales = [layout.scale for layout in layouts]
    if all(scale.numel() == 1 for scale in scales) and all(
        torch.equal(scale, scales[0]) for scale in scales
    ):
        scale = scales[0]
    else:
        scale = torch.cat(
            [s.expand(layout.weight.shape[0]) for s, layout in zip(scales, layouts, strict=True)]
        )
    inputs = [layout.input_scale for layout in layouts if layout.input_scale is not None]
    input_scale = torch.stack(inputs).amax(0) if len(inputs) == len(layouts) else None
    weight = torch.cat([layout.weight for layout in layouts])
    return Fp8ChannelLayout(weight, scale.contiguous(), input_scale)


def _concatenate_int4(layouts: Sequence[Int4Layout]) -> Int4Layout | str:
    first = layouts[0]
    same = all(
        layout.group == first.group
        and layout.in_features == first.in_features
        and layout.scales.shape[1] == first.scales.shape[1]
        and layout.scales.dtype == first.scales.dtype
        and (layout.zeros is None) == (first.zeros is None)
        for layout in layouts
    )
    if not same:
        return "its shards have different int4 groups"
    zeros = None
    if first.zeros is not None:
        zeros = torch.cat([layout.zeros for layout in layouts])  # type: ignore[misc]
    return replace(
        first,
        qweight=torch.cat([layout.qweight for layout in layouts]),
        scales=torch.cat([layout.scales for layout in layouts]),
        zeros=zeros,
    )

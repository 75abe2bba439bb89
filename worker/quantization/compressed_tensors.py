"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, llm-compressor's format).

The config lists `config_groups`, each with `targets` (module class names such as `Linear`, or
`re:` patterns on module names), `weights` quantization args (`num_bits`, `type`, `strategy`,
`group_size`, `block_structure`, `symmetric`) and activation args, plus a storage `format` per
group or for the whole checkpoint; `ignore` lists modules left unquantized (stored plain).

Each group is read by the `GroupScheme` its (format, weight type, bits) picks in
`GROUP_SCHEMES`; a combination without one (int8 W8A8, NVFP4, 2:4 sparse, ...) is refused at
start-up in one line naming it. A quantized tensor is dequantized by the group that targets its
module and recognises its parts.

FP8 (`float-quantized`, weights float 8-bit, symmetric): `X.weight` float8_e4m3fn with
`X.weight_scale`, [1] per tensor, [N, 1] per output channel or [ceil(N/bn), ceil(K/bk)] per
block (`block_structure` [bn, bk]); `X.input_scale` (static activations) is unused when
computing in 16 bits.

W4A16 (`pack-quantized`, weights int 4-bit, group or channel scales): read by
`int4.PackedInt4Group` (packed codes, scales, packed zero points, g_idx).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch

from worker.quantization.int4 import PackedInt4Group
from worker.quantization.scheme import WEIGHT_ROLE, check_shape, expand_blocks, require

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_DTYPE_NAMES = ("F8_E4M3", "F8_E5M2")
SPARSE_FORMATS = {"marlin-24", "sparse-24-bitmask", "sparse-bitmask"}


class GroupScheme(Protocol):
    """How the tensors of one config group are stored and dequantized."""

    part_suffixes: Mapping[str, str]
    """Checkpoint name suffix of a part stored beside the weight -> its role (a suffix two
    groups share has one role: its name without the dot, e.g. `weight_scale`)."""

    def accepts(self, parts: Mapping[str, torch.Tensor]) -> bool:
        """Whether `parts` (by role) are this group's storage of one tensor."""

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 tensor `logical` (as in the unquantized checkpoint)."""

    def check_plain(self, name: str, dtype_name: str) -> None:
        """ValueError when a tensor without parts is stored as this group stores weights."""


GroupBuilder = Callable[[str, Mapping[str, Any]], GroupScheme]


class Fp8Group:
    """FP8 weights with one scale per tensor, per output channel or per block."""

    part_suffixes: Mapping[str, str] = MappingProxyType(
        {".weight_scale": "weight_scale", ".input_scale": "input_scale"}
    )
    STRATEGIES = ("tensor", "channel", "block")

    def __init__(self, group: str, weights: Mapping[str, Any]) -> None:
        self.strategy = str(weights.get("strategy"))
        if self.strategy not in self.STRATEGIES or weights.get("symmetric") is False:
            raise ValueError(
                f"compressed-tensors config group {group}: FP8 weights with strategy "
                f"{self.strategy!r}{'' if weights.get('symmetric', True) else ', asymmetric'} "
                f"are not supported; supported strategies: {', '.join(self.STRATEGIES)}"
            )
        self.block: tuple[int, int] | None = None
        if self.strategy == "block":
            block = weights.get("block_structure")
            if not isinstance(block, list) or len(block) != 2 or min(block) < 1:
                raise ValueError(
                    f"compressed-tensors config group {group}: block strategy needs "
                    f"block_structure [rows, cols], got {block!r}"
                )
            self.block = (int(block[0]), int(block[1]))

    def accepts(self, parts: Mapping[str, torch.Tensor]) -> bool:
        weight = parts.get(WEIGHT_ROLE)
        return weight is not None and weight.dtype in FP8_DTYPES

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        weight, scale = require(logical, parts, WEIGHT_ROLE, "weight_scale")
        values, scale = weight.to(torch.float32), scale.to(torch.float32)
        name = f"{logical}_scale"
        if self.strategy == "tensor":
            check_shape(name, scale.reshape(-1), (1,), "one per-tensor scale")
            return values * scale.reshape(())
        if self.strategy == "channel":
            expected = (*weight.shape[:-1], 1)
            check_shape(name, scale, expected, f"one scale per output row of {tuple(weight.shape)}")
            return values * scale
        assert self.block is not None
        rows, cols = self.block
        blocks = (*weight.shape[:-2], -(-weight.shape[-2] // rows), -(-weight.shape[-1] // cols))
        check_shape(name, scale, blocks, f"{rows}x{cols} blocks of {tuple(weight.shape)}")
        return values * expand_blocks(scale, self.block, weight.shape)

    def check_plain(self, name: str, dtype_name: str) -> None:
        if dtype_name in FP8_DTYPE_NAMES:
            raise ValueError(f"checkpoint tensor {name} is {dtype_name} but has no weight_scale")


GROUP_SCHEMES: dict[tuple[str, str, int], GroupBuilder] = {
    ("float-quantized", "float", 8): Fp8Group,
    ("naive-quantized", "float", 8): Fp8Group,
    ("pack-quantized", "int", 4): PackedInt4Group,
}
"""(storage format, weight type, weight bits) -> the group scheme that reads it."""


class CompressedTensorsScheme:
    """Dispatches each quantized tensor to the config group that targets it."""

    method = "compressed-tensors"

    def __init__(self, quant_config: Mapping[str, Any]) -> None:
        _refuse_sparsity(quant_config)
        groups = quant_config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        default_format = quant_config.get("format")
        self.groups = [
            (name, _targets(name, group), _group_scheme(name, group, default_format))
            for name, group in groups.items()
        ]

    def part_of(self, name: str) -> tuple[str, str] | None:
        for _, _, scheme in self.groups:
            for suffix, role in scheme.part_suffixes.items():
                if name.endswith(suffix):
                    return name.removesuffix(suffix) + ".weight", role
        return None

    def dequantize(self, logical: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.group_for(logical, parts).dequantize(logical, parts)

    def group_for(self, logical: str, parts: Mapping[str, torch.Tensor]) -> GroupScheme:
        """The config group that targets `logical`'s module and stores its `parts`."""
        module = logical.removesuffix(".weight")
        targeted = sorted(
            (rank, index, scheme)
            for index, (_, targets, scheme) in enumerate(self.groups)
            if (rank := _target_rank(targets, module)) is not None
        )
        for _, _, scheme in targeted:
            if scheme.accepts(parts):
                return scheme
        raise ValueError(
            f"quantized checkpoint tensor {logical} (parts: {', '.join(sorted(parts))}) is "
            f"stored as no config group that targets {module} "
            f"({', '.join(name for name, _, _ in self.groups)})"
        )

    def check_plain(self, name: str, dtype_name: str) -> None:
        for _, _, scheme in self.groups:
            scheme.check_plain(name, dtype_name)


def _group_scheme(name: str, group: Mapping[str, Any], default_format: Any) -> GroupScheme:
    """The scheme of config group `name`; ValueError naming any scheme we cannot read."""
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"compressed-tensors config group {name} quantizes no weights")
    storage = str(group.get("format") or default_format or "")
    key = (storage, str(weights.get("type")), int(weights.get("num_bits") or 0))
    builder = GROUP_SCHEMES.get(key)
    if builder is None:
        raise ValueError(
            f"compressed-tensors scheme {_describe(storage, weights, group)} (config group "
            f"{name}) is not supported; supported: FP8 weights (float-quantized, per tensor, "
            "channel or block), W4A16 int4 (pack-quantized, group or channel)"
        )
    return builder(name, weights)


def _describe(storage: str, weights: Mapping[str, Any], group: Mapping[str, Any]) -> str:
    """A scheme's usual name: `W8A8 int8 (int-quantized, channel)`, `NVFP4 (...)`, ..."""
    kind, bits = str(weights.get("type")), int(weights.get("num_bits") or 0)
    acts = group.get("input_activations")
    act_bits = int(acts.get("num_bits") or 16) if isinstance(acts, dict) else 16
    name = f"W{bits}A{act_bits} {kind}{bits}"
    if kind == "float" and bits == 4:
        name = "NVFP4" if weights.get("group_size") == 16 else "MXFP4"
    if storage in SPARSE_FORMATS:
        name = f"2:4 sparse {name}" if "24" in storage else f"sparse {name}"
    return f"{name} ({storage or 'no format'}, {weights.get('strategy')})"


def _refuse_sparsity(quant_config: Mapping[str, Any]) -> None:
    sparsity = quant_config.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity and sparsity.get("format", "dense") != "dense":
        structure = sparsity.get("sparsity_structure", "unstructured")
        raise ValueError(
            f"compressed-tensors scheme {structure} sparse weights ({sparsity.get('format')}) "
            "is not supported"
        )


def _targets(name: str, group: Mapping[str, Any]) -> tuple[str, ...]:
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"compressed-tensors config group {name} has no targets")
    return tuple(str(target) for target in targets)


def _target_rank(targets: tuple[str, ...], module: str) -> int | None:
    """How specifically `targets` name `module`: 0 by name or `re:` pattern, 1 by a class name
    (every quantized tensor's module is taken to be of its class), None not at all."""
    ranks = []
    for target in targets:
        if target.startswith("re:"):
            pattern = target.removeprefix("re:")
            if re.match(pattern, module) or re.match(pattern, f"{module}.weight"):
                ranks.append(0)
        elif target == module:
            ranks.append(0)
        elif target[:1].isupper():  # a class name: Linear, ...
            ranks.append(1)
    return min(ranks, default=None)

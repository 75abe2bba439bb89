"""Group each quantized tensor's parts and hand the model one lazily dequantized source.

The loader sees every checkpoint tensor by name (all files open at once, since a tensor's
scales may sit in another shard). Tensors that are parts of a quantized tensor are replaced by
one `DequantizedWeight` under the logical name, at the place of its first part; everything else
passes through untouched. A `DequantizedWeight` dequantizes on first read and is dropped with
its loop iteration, so at most one dequantized tensor is alive beyond the model's parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.quantization.scheme import WEIGHT_ROLE, WeightScheme

logger = logging.getLogger(__name__)

GIB = 1 << 30


class CheckpointTensor(Protocol):
    """A lazily read checkpoint tensor that knows its safetensors dtype name."""

    dtype_name: str

    @property
    def shape(self) -> Sequence[int]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def read_all(self) -> torch.Tensor: ...


@dataclass
class DequantizationReport:
    """What dequantizing at load cost: tensors, parameters and bytes before and after."""

    method: str
    tensors: int = 0
    parameters: int = 0
    checkpoint_bytes: int = 0

    def describe(self, dtype: torch.dtype) -> str:
        after = self.parameters * dtype.itemsize
        return (
            f"dequantized {self.tensors} {self.method} tensors ({self.parameters / 1e6:.1f}M "
            f"parameters) at load: {self.checkpoint_bytes / GIB:.3f} GiB in the checkpoint, "
            f"{after / GIB:.3f} GiB as {str(dtype).removeprefix('torch.')} "
            f"({after / max(self.checkpoint_bytes, 1):.2f}x)"
        )


@dataclass
class DequantizedWeight:
    """A `WeightSource` whose tensor is computed from quantized parts on first read."""

    logical: str
    parts: dict[str, CheckpointTensor]
    scheme: WeightScheme
    report: DequantizationReport
    _tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def shape(self) -> Sequence[int]:
        return tuple(self.tensor().shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor().narrow(dim, start, length)

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            read = {role: part.read_all() for role, part in self.parts.items()}
            self._tensor = self.scheme.dequantize(self.logical, read)
            self.report.tensors += 1
            self.report.parameters += self._tensor.numel()
            self.report.checkpoint_bytes += sum(
                tensor.numel() * tensor.element_size() for tensor in read.values()
            )
        return self._tensor


def dequantized_weights(
    tensors: Mapping[str, CheckpointTensor], scheme: WeightScheme, report: DequantizationReport
) -> Iterator[tuple[str, CheckpointTensor | DequantizedWeight]]:
    """`(name, source)` over `tensors` (checkpoint order) with quantized parts grouped."""
    groups = _group_parts(tensors, scheme)
    member_of = {name: logical for logical, parts in groups.items() for name in parts.values()}
    yielded: set[str] = set()
    for name, tensor in tensors.items():
        logical = member_of.get(name)
        if logical is None:
            scheme.check_plain(name, tensor.dtype_name)
            yield name, tensor
        elif logical not in yielded:
            yielded.add(logical)
            parts = {role: tensors[part] for role, part in groups[logical].items()}
            yield logical, DequantizedWeight(logical, parts, scheme, report)


def _group_parts(
    tensors: Mapping[str, CheckpointTensor], scheme: WeightScheme
) -> dict[str, dict[str, str]]:
    """logical name -> {role: checkpoint name} (the logical name itself as `WEIGHT_ROLE`)."""
    groups: dict[str, dict[str, str]] = {}
    for name in tensors:
        found = scheme.part_of(name)
        if found is None:
            continue
        logical, role = found
        group = groups.setdefault(logical, {})
        if role in group:
            raise ValueError(f"checkpoint tensors {group[role]} and {name} both give {role}")
        group[role] = name
    for logical, group in groups.items():
        if logical in tensors:
            group[WEIGHT_ROLE] = logical
    return groups

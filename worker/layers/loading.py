"""How a layer reads its part of a checkpoint tensor.

Checkpoint tensors arrive as `WeightSource`s: a `torch.Tensor`, or a lazy safetensors slice that
reads from disk only the rows or columns asked for. Each parameter carries a
`weight_loader(param, source, shard_id=None)` that copies this rank's shard into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, Union

import torch
from torch import nn


class LazyWeight(Protocol):
    """A checkpoint tensor that is read only when (part of) it is asked for."""

    @property
    def shape(self) -> Sequence[int]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...


WeightSource = Union[torch.Tensor, LazyWeight]  # noqa: UP007 (runtime alias on Python 3.10)
ShardId = Union[str, int, None]  # noqa: UP007
WeightLoader = Callable[[nn.Parameter, WeightSource, ShardId], None]


def read_full(source: WeightSource) -> torch.Tensor:
    """The whole tensor."""
    if isinstance(source, torch.Tensor):
        return source
    return source.narrow(0, 0, source.shape[0])


def read_part(source: WeightSource, dim: int, start: int, length: int) -> torch.Tensor:
    """Elements `[start, start + length)` of `dim`, clipped to the tensor's end."""
    length = max(0, min(length, int(source.shape[dim]) - start))
    return source.narrow(dim, start, length)


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy `loaded` into `target` (any dtype or device), insisting on equal shapes."""
    if tuple(target.shape) != tuple(loaded.shape):
        raise ValueError(
            f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit a parameter "
            f"(shard) of shape {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(loaded)


def default_weight_loader(
    param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
) -> None:
    """Loader of replicated parameters: the whole checkpoint tensor, unsplit."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shard {shard_id!r}")
    copy_checked(param.data, read_full(source))


def new_parameter(
    shape: Sequence[int], loader: WeightLoader, fill: float | None = None
) -> nn.Parameter:
    """An inference-only parameter (default dtype and device) that knows its `weight_loader`."""
    data = torch.empty(*shape) if fill is None else torch.full(tuple(shape), fill)
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The parameter's own loader, or the replicated one."""
    loader: WeightLoader = getattr(param, "weight_loader", default_weight_loader)
    return loader

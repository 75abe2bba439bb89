"""The base of every layer whose per-request memory is a recurrent state kept in the paged KV
pool (Mamba-2 mixers, gated DeltaNet, short convolution).

The runner finds these layers by this type, asks each for its `MambaSpec` (one page per state)
and hands each its Mamba metadata (`worker.state.mamba_metadata`) and state views every step.
`state_waves` is the loop every such layer runs: the step's tokens in waves, so that a request
reading a state another request writes in the same step runs after it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from scheduler.kv_cache.spec import MambaCacheMode, MambaSpec
from worker.kv_io.cache_shard_layout import CacheShardLayout
from worker.state.mamba_metadata import MambaMetadata, MambaWave


class StateLayer(nn.Module, abc.ABC):
    """A layer holding a recurrent state per request in its KV cache group."""

    cfg: Any
    """The layer's frozen config (a dataclass with a `layer_name`)."""

    def rename(self, layer_name: str) -> None:
        """Key the layer's spec, views and metadata under `layer_name` (a drafter's layers)."""
        self.cfg = replace(self.cfg, layer_name=layer_name)

    @property
    @abc.abstractmethod
    def layer_name(self) -> str:
        """The key of the layer's KV cache spec, state views and metadata."""

    @abc.abstractmethod
    def kv_cache_spec(self, block_size: int, dtype_bytes: int, mode: MambaCacheMode) -> MambaSpec:
        """This rank's state spec: every state tensor in `dtype_bytes`-byte elements (the
        state dtype, `mamba_ssm_cache_dtype`)."""

    @abc.abstractmethod
    def cache_shard_layouts(self) -> tuple[CacheShardLayout, ...]:
        """How tensor parallelism cuts each state tensor (the spec's shapes, in order)."""


Rows = Callable[[torch.Tensor], torch.Tensor]
"""Takes a wave's rows of a step tensor [T, *] (the identity when the wave is the whole step)."""


def state_waves(
    meta: MambaMetadata, like: torch.Tensor, run: Callable[[Rows, MambaWave], torch.Tensor]
) -> torch.Tensor:
    """`run` once per wave; its outputs [n, F] placed at the wave's rows of a [T, F] result.

    `like` [T, *] gives the result's length, dtype and device."""
    if len(meta.waves) == 1 and meta.waves[0].token_index is None:
        return run(lambda x: x, meta.waves[0])
    out: torch.Tensor | None = None
    for wave in meta.waves:
        index = wave.token_index
        assert index is not None
        part = run(lambda x, index=index: x[index], wave)  # type: ignore[misc]
        if out is None:
            out = like.new_empty(like.shape[0], *part.shape[1:])
        out[index] = part
    assert out is not None
    return out


def initial_states(cache: torch.Tensor, wave: MambaWave, dtype: torch.dtype) -> torch.Tensor:
    """The states the wave's sequences start from, in the kernels' `dtype`: their read blocks
    (converted from the state dtype of the pool), zeros for fresh ones."""
    keep = wave.has_state.view(-1, *([1] * (cache.dim() - 1)))
    return torch.where(keep, cache[wave.read_blocks].to(dtype), 0)


def store_states(
    cache: torch.Tensor, wave: MambaWave, final: torch.Tensor, cut: torch.Tensor
) -> None:
    """Write the wave's final states (and the states at its cut positions) into the pool,
    converted to its state dtype: the one place states are stored."""
    cache[wave.write_blocks] = final.to(cache.dtype)
    if wave.cut_positions:
        cache[wave.cut_blocks] = cut.to(cache.dtype)

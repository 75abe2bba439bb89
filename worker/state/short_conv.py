"""LFM2's short-convolution block, tensor-parallel over channels, with its conv state in the
paged KV pool (`ShortConvSpec`).

    in_proj -> B, C, x (each [T, channels]); y = C * causal_conv1d(B * x)  (conv state in/out)
    out_proj (row parallel)

Rank r holds channels [r * c, (r + 1) * c) of B, C, x and of the depthwise conv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.mamba_reference import ConvOutput
from scheduler.kv_cache.linear_state_spec import ShortConvShape, ShortConvSpec
from scheduler.kv_cache.spec import MambaCacheMode
from worker.attention.attention import ForwardContext
from worker.config import ParallelConfig
from worker.kv_io.cache_shard_layout import CacheShardLayout, heads_layout
from worker.layers.linear import ProjectionWeights, RowParallelLinear
from worker.layers.loading import ShardId, WeightSource, copy_checked, new_parameter, read_part
from worker.state.mamba_metadata import MambaWave
from worker.state.state_layer import Rows, StateLayer, initial_states, state_waves, store_states


@dataclass(frozen=True)
class ShortConvConfig:
    """Static description of one short-convolution block (whole model sizes)."""

    layer_name: str
    hidden_size: int
    conv_width: int
    bias: bool


class _Params(nn.Module):
    """Named parameters (checkpoint names `in_proj.weight`, `conv.bias`, ...)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


class ShortConv(StateLayer):
    """transformers' `Lfm2ShortConv` numerics."""

    cfg: ShortConvConfig

    def __init__(self, cfg: ShortConvConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.cfg, self.rank = cfg, parallel.rank
        self.local = ShortConvShape(cfg.hidden_size, cfg.conv_width).per_rank(parallel.tp_size)
        channels, hidden = self.local.channels, cfg.hidden_size

        def param(shape: tuple[int, ...], loader: object) -> nn.Parameter:
            return new_parameter(shape, loader)  # type: ignore[arg-type]

        self.in_proj = ProjectionWeights(
            param((3 * channels, hidden), self._load_in_proj),
            param((3 * channels,), self._load_in_proj) if cfg.bias else None,
        )
        self.conv = _Params(
            param((channels, 1, cfg.conv_width), self._load_channels),
            param((channels,), self._load_channels) if cfg.bias else None,
        )
        self.out_proj = RowParallelLinear(hidden, hidden, parallel, bias=cfg.bias)

    @property
    def layer_name(self) -> str:
        return self.cfg.layer_name

    def kv_cache_spec(
        self, block_size: int, dtype_bytes: int, mode: MambaCacheMode
    ) -> ShortConvSpec:
        return self.local.spec(block_size, dtype_bytes, mode)

    def cache_shard_layouts(self) -> tuple[CacheShardLayout, ...]:
        """The conv state [channels, width - 1] by channels."""
        return (heads_layout(-2, self.cfg.hidden_size),)

    def _load_channels(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        size = self.local.channels
        copy_checked(param.data, read_part(source, 0, self.rank * size, size))

    def _load_in_proj(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's channels of each of B, C and x."""
        size, full = self.local.channels, self.cfg.hidden_size
        parts = [read_part(source, 0, part * full + self.rank * size, size) for part in range(3)]
        copy_checked(param.data, torch.cat(parts))

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes this layer's conv state in the pool."""
        projected = self.in_proj(hidden)
        b, c, x = projected.chunk(3, dim=-1)
        gated_in = b * x
        meta = ctx.mamba_metadata[self.layer_name]
        (cache,) = ctx.kv_caches[self.layer_name]

        def run(rows: Rows, wave: MambaWave) -> torch.Tensor:
            tokens = rows(gated_in)
            conv: ConvOutput = meta.kernels.causal_conv1d(  # type: ignore[assignment]
                tokens, self.conv.weight[:, 0], self.conv.bias,
                initial_states(cache, wave, tokens.dtype), wave.query_start_loc,
                activation=None, cut_positions=wave.cut_positions,
            )  # fmt: skip
            store_states(cache, wave, conv.final_states, conv.cut_states)
            return conv.out

        y = c * state_waves(meta, gated_in, run)
        return self.out_proj(y)  # type: ignore[no-any-return]

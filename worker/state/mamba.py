"""The Mamba-2 mixer layer, tensor-parallel over heads, with its state in the paged KV pool.

    in_proj -> [z | x B C | dt]; causal conv1d over xBC (conv state in/out); SSD scan over
    x, dt, B, C (SSM state in/out); y * silu(z); grouped RMSNorm; out_proj (row parallel)

Each rank holds `num_heads / tp` heads and the B/C groups those heads read (groups split over
ranks, or one group replicated on every rank). A layer's state per request is a conv state
`[conv_dim, width - 1]` and an SSM state `[heads, head_dim, state_size]`, both in the model
dtype, kept in one page of its KV cache group (`MambaSpec`); the metadata of the step
(`worker.state.mamba_metadata`) names the blocks to read and write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.batch_invariant import TORCH_MATH, LayerMath
from scheduler.kv_cache.spec import MambaCacheMode, MambaSpec
from worker.attention.attention import ForwardContext
from worker.config import ParallelConfig
from worker.distributed import all_reduce
from worker.kv_io.cache_shard_layout import CachePart, CacheShardLayout, heads_layout
from worker.layers.linear import ProjectionWeights, RowParallelLinear
from worker.layers.loading import ShardId, WeightSource, copy_checked, new_parameter, read_part
from worker.state.mamba_metadata import MambaWave
from worker.state.state_layer import StateLayer, initial_states, store_states


@dataclass(frozen=True)
class MambaConfig:
    """Static description of one Mamba-2 layer (whole model sizes, not per rank)."""

    layer_name: str
    hidden_size: int
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_width: int
    chunk_size: int
    norm_eps: float
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class _Layout:
    """This rank's share: heads, groups and where its rows sit in the checkpoint tensors."""

    heads: int
    groups: int
    first_head: int
    first_group: int
    norm_spans_ranks: bool
    """One B/C group serves every rank: the gated norm's statistics need an all-reduce."""


def _layout(cfg: MambaConfig, parallel: ParallelConfig) -> _Layout:
    tp, rank = parallel.tp_size, parallel.rank
    if cfg.num_heads % tp:
        raise ValueError(
            f"{cfg.layer_name}: mamba heads ({cfg.num_heads}) are not divisible by "
            f"tp_size={tp}; choose a tensor_parallel_size that divides {cfg.num_heads}"
        )
    heads = cfg.num_heads // tp
    if cfg.num_groups % tp == 0:
        groups, first_group = cfg.num_groups // tp, rank * (cfg.num_groups // tp)
    elif cfg.num_groups == 1:
        groups, first_group = 1, 0
    else:
        raise ValueError(
            f"{cfg.layer_name}: mamba groups ({cfg.num_groups}) must be 1 or a multiple of "
            f"tp_size={tp}"
        )
    return _Layout(heads, groups, rank * heads, first_group, cfg.num_groups < tp)


class _Params(nn.Module):
    """A named holder of parameters (checkpoint names `conv1d.weight`, `norm.weight`, ...)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias


class MambaMixer2(StateLayer):
    """Mamba-2 mixer (transformers' `BambaMixer` / `NemotronHMamba2Mixer` numerics)."""

    cfg: MambaConfig

    def __init__(self, cfg: MambaConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""
        self.layout = _layout(cfg, parallel)
        lay, n = self.layout, cfg.state_size
        self.inner = lay.heads * cfg.head_dim
        self.conv_dim = self.inner + 2 * lay.groups * n
        full_inner, full_groups = cfg.intermediate_size, cfg.num_groups * n
        # (start in the checkpoint rows, size) of this rank's z, x, B, C, dt rows
        x_rows = (full_inner + lay.first_head * cfg.head_dim, self.inner)
        b_rows = (2 * full_inner + lay.first_group * n, lay.groups * n)
        c_rows = (b_rows[0] + full_groups, lay.groups * n)
        dt_rows = (2 * full_inner + 2 * full_groups + lay.first_head, lay.heads)
        z_rows = (lay.first_head * cfg.head_dim, self.inner)
        self.in_proj_rows = (z_rows, x_rows, b_rows, c_rows, dt_rows)
        self.conv_rows = tuple(
            (start - full_inner, size) for start, size in (x_rows, b_rows, c_rows)
        )
        out_features = 2 * self.inner + 2 * lay.groups * n + lay.heads
        self.in_proj = ProjectionWeights(
            weight=new_parameter((out_features, cfg.hidden_size), self._load_in_proj),
            bias=new_parameter((out_features,), self._load_in_proj) if cfg.proj_bias else None,
        )
        self.conv1d = _Params(
            weight=new_parameter((self.conv_dim, 1, cfg.conv_width), self._load_conv),
            bias=new_parameter((self.conv_dim,), self._load_conv) if cfg.conv_bias else None,
        )
        self.A_log = new_parameter((lay.heads,), self._load_heads)
        self.D = new_parameter((lay.heads,), self._load_heads)
        self.dt_bias = new_parameter((lay.heads,), self._load_heads)
        self.norm = _Params(weight=new_parameter((self.inner,), self._load_norm))
        self.out_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size, parallel, bias=cfg.proj_bias
        )

    @property
    def layer_name(self) -> str:
        return self.cfg.layer_name

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """This rank's conv state and SSM state shapes per request."""
        return (
            (self.conv_dim, self.cfg.conv_width - 1),
            (self.layout.heads, self.cfg.head_dim, self.cfg.state_size),
        )

    def kv_cache_spec(self, block_size: int, dtype_bytes: int, mode: MambaCacheMode) -> MambaSpec:
        """This layer's spec: both states in `dtype_bytes`-byte elements, one state per block."""
        return MambaSpec(
            block_size=block_size,
            shapes=self.state_shapes(),
            dtype_bytes=(dtype_bytes, dtype_bytes),
            mamba_cache_mode=mode,
        )

    def cache_shard_layouts(self) -> tuple[CacheShardLayout, ...]:
        """Conv state channels x | B | C, as the conv weight's rows (B and C replicated when
        one group serves every rank); SSM state by heads."""
        cfg = self.cfg
        conv = CacheShardLayout(
            -2,
            (
                CachePart(cfg.num_heads, cfg.head_dim),
                CachePart(cfg.num_groups, cfg.state_size),
                CachePart(cfg.num_groups, cfg.state_size),
            ),
        )
        return (conv, heads_layout(-3, cfg.num_heads))

    # -- weight loading -------------------------------------------------------------------

    def _load_rows(
        self, param: nn.Parameter, source: WeightSource, rows: Sequence[tuple[int, int]]
    ) -> None:
        parts = [read_part(source, 0, start, size) for start, size in rows]
        copy_checked(param.data, torch.cat(parts).reshape(param.shape))

    def _load_in_proj(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        self._load_rows(param, source, self.in_proj_rows)

    def _load_conv(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        self._load_rows(param, source, self.conv_rows)

    def _load_heads(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        self._load_rows(param, source, ((self.layout.first_head, self.layout.heads),))

    def _load_norm(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        start = self.layout.first_head * self.cfg.head_dim
        self._load_rows(param, source, ((start, self.inner),))

    # -- forward --------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes this layer's states in the pool."""
        lay = self.layout
        projected = self.in_proj(hidden)
        z, xbc, dt = torch.split(projected, [self.inner, self.conv_dim, lay.heads], dim=-1)
        y = torch.empty(hidden.shape[0], self.inner, dtype=hidden.dtype, device=hidden.device)
        meta = ctx.mamba_metadata[self.layer_name]
        caches = ctx.kv_caches[self.layer_name]
        for wave in meta.waves:
            rows = wave.token_index
            out = self._mix(
                xbc if rows is None else xbc[rows], dt if rows is None else dt[rows], wave, caches,
                meta.kernels,
            )  # fmt: skip
            if rows is None:
                y = out
            else:
                y[rows] = out
        return self.out_proj(self._gated_norm(y, z))  # type: ignore[no-any-return]

    def _mix(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        wave: MambaWave,
        caches: tuple[torch.Tensor, ...],
        kernels: object,
    ) -> torch.Tensor:
        """Conv, then scan, of one wave's tokens; states read before and written after."""
        conv_cache, ssm_cache = caches
        lay, cfg = self.layout, self.cfg
        conv = kernels.causal_conv1d(  # type: ignore[attr-defined]
            xbc, self.conv1d.weight[:, 0], self.conv1d.bias,
            initial_states(conv_cache, wave, xbc.dtype), wave.query_start_loc,
            activation="silu", cut_positions=wave.cut_positions,
        )  # fmt: skip
        bc_size = lay.groups * cfg.state_size
        x, b, c = torch.split(conv.out, [self.inner, bc_size, bc_size], dim=-1)
        ssm_init = initial_states(ssm_cache, wave, torch.float32)
        num_tokens = x.shape[0]
        scan = kernels.ssd_scan(  # type: ignore[attr-defined]
            x.reshape(num_tokens, lay.heads, cfg.head_dim), dt, -torch.exp(self.A_log.float()),
            b.reshape(num_tokens, lay.groups, cfg.state_size),
            c.reshape(num_tokens, lay.groups, cfg.state_size), self.D, self.dt_bias, ssm_init,
            wave.query_start_loc, cfg.chunk_size, cfg.dt_limit, wave.cut_positions,
        )  # fmt: skip
        store_states(conv_cache, wave, conv.final_states, conv.cut_states)
        store_states(ssm_cache, wave, scan.final_states, scan.cut_states)
        out: torch.Tensor = scan.out.reshape(num_tokens, self.inner)
        return out

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of y * silu(z) over each B/C group's features, in fp32, then the weight."""
        gated = y.float() * self.math.pointwise(F.silu, z.float())
        lay = self.layout
        if lay.norm_spans_ranks:
            total = all_reduce(gated.pow(2).sum(-1, keepdim=True))
            normed = gated * torch.rsqrt(total / self.cfg.intermediate_size + self.cfg.norm_eps)
        else:
            grouped = gated.view(gated.shape[0], lay.groups, -1)
            var = grouped.pow(2).mean(-1, keepdim=True)
            normed = (grouped * torch.rsqrt(var + self.cfg.norm_eps)).view_as(gated)
        return self.norm.weight * normed.to(y.dtype)

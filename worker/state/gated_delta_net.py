"""The gated DeltaNet layer of Qwen3-Next and Qwen3.5, tensor-parallel over heads, with its
conv and recurrent states in the paged KV pool (`GatedDeltaNetSpec`).

    project -> q k v (conv channels), z (output gate), b (beta), a (decay)
    causal conv1d + silu over [q | k | v]      (conv state in/out)
    l2-normalised q, k; gated delta rule       (recurrent state [Hv, Dk, Dv] in/out)
    RMSNorm(o) * silu(z) per value head; out_proj (row parallel)

A decode step (one token per sequence) runs conv to output in one fused function when the
step's delta-rule kernels bring one; the output-gated norm runs on the device's layer kernels.

Checkpoint layouts: Qwen3.5 keeps `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`;
Qwen3-Next fuses them per key head as `in_proj_qkvz` ([q | k | v | z] of each key head's
group of value heads) and `in_proj_ba`. Rank r holds key heads [r * hk, (r + 1) * hk) and the
value heads that read them, so its rows are contiguous in the fused layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.batch_invariant import TORCH_MATH, LayerMath
from kernels.gated_delta_decode import DecodeStepInputs, DecodeStepOutput, DecodeStepWeights
from kernels.gated_delta_reference import DeltaRuleInputs, gate_and_beta, l2_normalize
from kernels.gated_delta_registry import DecodeStepFn
from scheduler.kv_cache.linear_state_spec import GatedDeltaNetShape, GatedDeltaNetSpec
from scheduler.kv_cache.spec import MambaCacheMode
from worker.attention.attention import ForwardContext
from worker.config import ParallelConfig
from worker.kv_io.cache_shard_layout import CachePart, CacheShardLayout, heads_layout
from worker.layers.linear import ProjectionWeights, RowParallelLinear
from worker.layers.loading import (
    ShardId,
    WeightSource,
    copy_checked,
    default_weight_loader,
    new_parameter,
    read_part,
)
from worker.layers.norm import layer_kernels
from worker.state.mamba_metadata import MambaMetadata, MambaWave
from worker.state.state_layer import Rows, StateLayer, initial_states, state_waves, store_states


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Static description of one gated DeltaNet layer (whole model sizes)."""

    layer_name: str
    hidden_size: int
    shape: GatedDeltaNetShape
    norm_eps: float
    fused_projections: bool
    """Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` (else Qwen3.5's four projections)."""
    chunk_size: int = 64


class _Weight(nn.Module):
    """A named holder of one parameter (checkpoint names `in_proj_qkv.weight`, ...)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class GatedDeltaNet(StateLayer):
    """transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet` numerics."""

    cfg: GatedDeltaNetConfig

    def __init__(self, cfg: GatedDeltaNetConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        self.cfg, self.rank = cfg, parallel.rank
        self.math: LayerMath = TORCH_MATH
        """Products against weights and pointwise functions (the batch-invariant mode's once
        installed)."""
        self.local = cfg.shape.per_rank(parallel.tp_size)
        loc, hidden = self.local, cfg.hidden_size
        self.key_size, self.value_size = (
            loc.num_k_heads * loc.head_k_dim,
            loc.num_v_heads * loc.head_v_dim,
        )
        self.conv_dim = loc.conv_dim
        if cfg.fused_projections:
            self.in_proj_qkvz = ProjectionWeights(
                new_parameter((self.conv_dim + self.value_size, hidden), self._load_rank_rows)
            )
            self.in_proj_ba = ProjectionWeights(
                new_parameter((2 * loc.num_v_heads, hidden), self._load_rank_rows)
            )
        else:
            self.in_proj_qkv = ProjectionWeights(
                new_parameter((self.conv_dim, hidden), self._load_conv_rows)
            )
            self.in_proj_z = ProjectionWeights(
                new_parameter((self.value_size, hidden), self._load_rank_rows)
            )
            self.in_proj_b = ProjectionWeights(
                new_parameter((loc.num_v_heads, hidden), self._load_rank_rows)
            )
            self.in_proj_a = ProjectionWeights(
                new_parameter((loc.num_v_heads, hidden), self._load_rank_rows)
            )
        width = cfg.shape.conv_width
        self.conv1d = _Weight(new_parameter((self.conv_dim, 1, width), self._load_conv_rows))
        self.A_log = new_parameter((loc.num_v_heads,), self._load_rank_rows)
        self.dt_bias = new_parameter((loc.num_v_heads,), self._load_rank_rows)
        self.norm = _Weight(new_parameter((loc.head_v_dim,), default_weight_loader, fill=1.0))
        full_values = cfg.shape.num_v_heads * cfg.shape.head_v_dim
        self.out_proj = RowParallelLinear(full_values, hidden, parallel)
        self.kernels = layer_kernels()

    @property
    def layer_name(self) -> str:
        return self.cfg.layer_name

    def kv_cache_spec(
        self, block_size: int, dtype_bytes: int, mode: MambaCacheMode
    ) -> GatedDeltaNetSpec:
        return self.local.spec(block_size, dtype_bytes, mode)

    def cache_shard_layouts(self) -> tuple[CacheShardLayout, ...]:
        """Conv state channels q | k | v, each by heads; recurrent state by value heads."""
        shape = self.cfg.shape
        key = CachePart(shape.num_k_heads, shape.head_k_dim)
        value = CachePart(shape.num_v_heads, shape.head_v_dim)
        conv = CacheShardLayout(-2, (key, key, value))
        return (conv, heads_layout(-3, shape.num_v_heads))

    # -- weight loading -------------------------------------------------------------------

    def _load_rank_rows(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's contiguous block of rows: its value heads (or their features), or its key
        heads' groups in the fused per-key-head layouts."""
        size = param.shape[0]
        copy_checked(param.data, read_part(source, 0, self.rank * size, size))

    def _load_conv_rows(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """[q | k | v] rows (projection or conv channels): this rank's heads of each part, each
        copied straight into its rows of the parameter (no concatenated temporary)."""
        full = self.cfg.shape
        full_key = full.num_k_heads * full.head_k_dim
        key, value = self.key_size, self.value_size
        parts = [  # (rows of the parameter, first row of the checkpoint tensor, rows)
            (0, self.rank * key, key),
            (key, full_key + self.rank * key, key),
            (2 * key, 2 * full_key + self.rank * value, value),
        ]
        for param_start, source_start, size in parts:
            target = param.data.narrow(0, param_start, size)
            copy_checked(target, read_part(source, 0, source_start, size))

    # -- forward --------------------------------------------------------------------------

    def _project(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv input [T, conv_dim], z [T, hv, Dv], b [T, hv], a [T, hv])."""
        loc, num_tokens = self.local, hidden.shape[0]
        if not self.cfg.fused_projections:
            return (
                self.in_proj_qkv(hidden),
                self.in_proj_z(hidden).view(num_tokens, -1, loc.head_v_dim),
                self.in_proj_b(hidden),
                self.in_proj_a(hidden),
            )
        ratio = loc.num_v_heads // loc.num_k_heads
        group = self.in_proj_qkvz(hidden).view(num_tokens, loc.num_k_heads, -1)
        q, k, v, z = torch.split(
            group,
            [loc.head_k_dim, loc.head_k_dim, ratio * loc.head_v_dim, ratio * loc.head_v_dim],
            -1,
        )
        ba = self.in_proj_ba(hidden).view(num_tokens, loc.num_k_heads, -1)
        b, a = torch.split(ba, [ratio, ratio], dim=-1)
        mixed = torch.cat([x.reshape(num_tokens, -1) for x in (q, k, v)], dim=-1)
        return (
            mixed,
            z.reshape(num_tokens, -1, loc.head_v_dim),
            b.reshape(num_tokens, -1),
            a.reshape(num_tokens, -1),
        )

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes this layer's states in the pool."""
        mixed, z, b, a = self._project(hidden)
        meta = ctx.mamba_metadata[self.layer_name]
        caches = ctx.kv_caches[self.layer_name]
        decode_step = meta.kernels.gated_delta.decode_step
        if decode_step is not None and _is_decode_step(meta):
            out = self._decode(decode_step, (mixed, a, b), meta.waves[0], caches)
        else:
            g, beta = gate_and_beta(a, b, self.A_log, self.dt_bias, self.math.pointwise)

            def run(rows: Rows, wave: MambaWave) -> torch.Tensor:
                return self._mix((rows(mixed), rows(g), rows(beta)), wave, caches, meta.kernels)

            out = state_waves(meta, mixed, run)
        return self.out_proj(self._gated_norm(out, z))  # type: ignore[no-any-return]

    def _decode(
        self,
        step: DecodeStepFn,
        tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        wave: MambaWave,
        caches: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """One token per sequence (conv input, a, b) through the kernels' fused decode step."""
        conv_cache, rec_cache = caches
        mixed, a, b = tokens
        inputs = DecodeStepInputs(
            mixed, a, b, initial_states(conv_cache, wave, mixed.dtype),
            initial_states(rec_cache, wave, torch.float32),
        )  # fmt: skip
        weights = DecodeStepWeights(self.conv1d.weight[:, 0], self.A_log, self.dt_bias)
        result: DecodeStepOutput = step(  # type: ignore[assignment]
            inputs, weights, self.local.num_k_heads, self.local.head_k_dim**-0.5
        )
        store_states(conv_cache, wave, result.conv_states, result.conv_states[:0])
        store_states(rec_cache, wave, result.states, result.states[:0])
        return result.out.reshape(mixed.shape[0], self.value_size)

    def _mix(
        self,
        tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        wave: MambaWave,
        caches: tuple[torch.Tensor, ...],
        kernels: object,
    ) -> torch.Tensor:
        """Conv, then the delta rule, of one wave's tokens (conv input, g, beta); states read
        before, written after."""
        conv_cache, rec_cache = caches
        loc, heads = self.local, self.local.num_v_heads
        mixed, g, beta = tokens
        conv = kernels.causal_conv1d(  # type: ignore[attr-defined]
            mixed, self.conv1d.weight[:, 0], None, initial_states(conv_cache, wave, mixed.dtype),
            wave.query_start_loc, activation="silu", cut_positions=wave.cut_positions,
        )  # fmt: skip
        q, k, v = torch.split(conv.out, [self.key_size, self.key_size, self.value_size], dim=-1)
        num_tokens = q.shape[0]
        inputs = DeltaRuleInputs(
            l2_normalize(q.reshape(num_tokens, loc.num_k_heads, loc.head_k_dim)),
            l2_normalize(k.reshape(num_tokens, loc.num_k_heads, loc.head_k_dim)),
            v.reshape(num_tokens, heads, loc.head_v_dim),
            g.float(),
            beta,
        )
        starts = wave.query_start_loc
        is_decode = starts[-1] == len(starts) - 1  # one token per sequence
        gated = kernels.gated_delta  # type: ignore[attr-defined]
        rule = gated.recurrent if is_decode else gated.chunked
        result = rule(
            inputs, initial_states(rec_cache, wave, torch.float32), starts,
            loc.head_k_dim**-0.5, wave.cut_positions,
        )  # fmt: skip
        store_states(conv_cache, wave, conv.final_states, conv.cut_states)
        store_states(rec_cache, wave, result.final_states, result.cut_states)
        out: torch.Tensor = result.out.reshape(num_tokens, self.value_size)
        return out

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Per value head: weight * RMSNorm(o) (cast back), times silu(z) in fp32."""
        heads = out.view(out.shape[0], -1, self.local.head_v_dim)
        gated = self.kernels.gated_rms_norm(heads, z, self.norm.weight, self.cfg.norm_eps)
        return gated.reshape(out.shape[0], -1)


def _is_decode_step(meta: MambaMetadata) -> bool:
    """Whether the step is one wave of every row with one token per sequence (no cuts then)."""
    if len(meta.waves) != 1 or meta.waves[0].token_index is not None:
        return False
    starts = meta.waves[0].query_start_loc
    return starts[-1] == len(starts) - 1

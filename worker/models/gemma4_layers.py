"""Building blocks of Gemma 4's text decoder: attention with per-layer shapes, and the MoE block.

Used by `worker.models.gemma4`; numerics follow transformers' `Gemma4TextAttention`,
`Gemma4TextRouter` and `Gemma4TextExperts`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from kernels.reference import KeyFromValue
from worker.config import ParallelConfig
from worker.distributed import all_reduce
from worker.layers.linear import (
    ReplicatedLinear,
    divide,
)
from worker.layers.loading import (
    ShardId,
    WeightSource,
    copy_checked,
    default_weight_loader,
    new_parameter,
    read_part,
)
from worker.layers.norm import unscaled_rms
from worker.layers.rotary import RotaryEmbedding, rope_parameters
from worker.models.expert_routes import expert_routes
from worker.models.gemma_shared_kv import SharedKVAttention


class Gemma4Attention(SharedKVAttention):
    """The shared-KV attention with per-layer shapes, and K = V on global layers.

    Where K = V (no value projection) V is the key projection normalised without a scale and
    not rotated, and K is that same tensor times the k-norm weight, rotated. The layer then
    caches V alone and the kernel rebuilds K from it (`KeyFromValue`): half the KV memory. A
    KV-sharing layer reading such a cache rebuilds keys with its target's k-norm weight.
    """

    def __init__(
        self, hf_config: PretrainedConfig, idx: int, target: int | None, parallel: ParallelConfig
    ) -> None:
        super().__init__(hf_config, idx, target, parallel)
        if self.keys_from_values:
            params = rope_parameters(hf_config, hf_config.layer_types[idx])
            self.key_rope = RotaryEmbedding(self.head_size, params)
            self._key_source: Callable[[], KeyFromValue] = self.key_from_value

    @staticmethod
    def layer_shape(hf_config: PretrainedConfig, idx: int) -> tuple[int, int]:
        """(head size, KV heads) of layer `idx`: global layers have their own
        (`per_layer_config`)."""
        layer_config = hf_config.per_layer_config[idx]
        return int(layer_config.head_dim), int(layer_config.num_key_value_heads)

    @staticmethod
    def caches_values_only(hf_config: PretrainedConfig, idx: int) -> bool:
        """Global layers of `attention_k_eq_v` models have no value projection: V comes from K."""
        return (
            bool(hf_config.attention_k_eq_v) and hf_config.layer_types[idx] != "sliding_attention"
        )

    @staticmethod
    def bidirectional_images_in_layer(hf_config: PretrainedConfig, idx: int) -> bool:
        """Sliding layers only: transformers' Gemma 4 masks keep global layers causal for image
        tokens too (`create_masks_for_vision_model`)."""
        return bool(hf_config.layer_types[idx] == "sliding_attention")

    def key_from_value(self) -> KeyFromValue:
        """How the kernel rebuilds this layer's keys from its cached values."""
        rope = self.key_rope
        return KeyFromValue(self.k_norm.weight, rope.inv_freq, rope.attention_scaling)

    def read_keys_of(self, target: Gemma4Attention) -> None:
        """A KV-sharing layer over a K = V cache rebuilds keys as its target does."""
        self._key_source = target.key_from_value

    def key_from_value_source(self) -> KeyFromValue | None:
        return self._key_source() if self.keys_from_values else None


class Gemma4Router(nn.Module):
    """Unscaled RMS norm, learned scale, softmax over experts, top-k renormalised, then scaled
    per expert: returns (weights, expert ids), each [T, k]."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        hidden, num = hf_config.hidden_size, hf_config.num_experts
        self.eps, self.top_k, self.root = (
            hf_config.rms_norm_eps,
            hf_config.top_k_experts,
            hidden**-0.5,
        )
        self.proj = ReplicatedLinear(hidden, num)
        self.scale = new_parameter((hidden,), default_weight_loader, fill=1.0)
        self.per_expert_scale = new_parameter((num,), default_weight_loader, fill=1.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = unscaled_rms(x, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(normed), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


class Gemma4Experts(nn.Module):
    """`gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj` [E, H, I]; this rank
    holds intermediate features [rank * I/tp, (rank + 1) * I/tp) of every expert."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        num, hidden = hf_config.num_experts, hf_config.hidden_size
        self.inner = hf_config.moe_intermediate_size
        self.inner_per_rank = divide(self.inner, parallel.tp_size, "moe_intermediate_size")
        self.parallel = parallel
        self.gate_up_proj = new_parameter((num, 2 * self.inner_per_rank, hidden), self.load_gate_up)
        self.down_proj = new_parameter((num, hidden, self.inner_per_rank), self.load_down)
        self.act = ACT2FN[hf_config.hidden_activation]

    def load_gate_up(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's gate rows and up rows of every expert."""
        start, size = self.parallel.rank * self.inner_per_rank, self.inner_per_rank
        gate = read_part(source, 1, start, size)
        up = read_part(source, 1, self.inner + start, size)
        copy_checked(param.data, torch.cat([gate, up], dim=1))

    def load_down(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's input columns of every expert's down projection."""
        size = self.inner_per_rank
        copy_checked(param.data, read_part(source, 2, self.parallel.rank * size, size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> sum over each token's chosen experts of weight * expert(x)."""
        out = torch.zeros_like(x)
        for expert, tokens, weight in expert_routes(chosen, weights, self.gate_up_proj.shape[0]):
            gate, up = (x[tokens] @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
            routed = (self.act(gate) * up) @ self.down_proj[expert].T
            out.index_add_(0, tokens, (routed * weight[:, None]).to(out.dtype))
        return all_reduce(out) if self.parallel.tp_size > 1 else out

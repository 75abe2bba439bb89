"""Cross-layer KV sharing of Gemma 3n and Gemma 4: which layers share, their attention, their
weights.

The last `num_kv_shared_layers` layers own no KV: each reads the cache of the last earlier layer
of its own type (sliding or full), through the generic KV sharing (so truncated prefill applies).
Such a layer projects only queries: its checkpoint `q_proj` loads into `query_proj` (not packed
into a qkv projection), and the K/V tensors some checkpoints still carry for it are not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from kernels.reference import KeyFromValue
from worker.attention.attention import Attention, AttentionConfig, ForwardContext
from worker.attention.kv_scales import read_kv_scales
from worker.config import ModelConfig, ParallelConfig
from worker.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from worker.layers.loading import WeightSource
from worker.layers.norm import RMSNorm, unscaled_rms
from worker.layers.rotary import RopeTables, apply_rotary
from worker.models.decoder import (
    DecoderForCausalLM,
    DecoderOptions,
    attention_layer_name,
    layer_prefix,
    window_from_layer_types,
)
from worker.weights import load_named_weights

_SHARED_LAYER_SKIPS = ("k_proj", "v_proj", "k_norm", "v_norm")
"""Attention tensors a KV-sharing layer has no use for."""


def kv_sharing_targets(hf_config: PretrainedConfig) -> dict[int, int]:
    """Shared layer -> the last non-shared layer of the same type before the shared run."""
    types = list(hf_config.layer_types)
    first_shared = hf_config.num_hidden_layers - (hf_config.num_kv_shared_layers or 0)
    targets = {}
    for idx in range(first_shared, hf_config.num_hidden_layers):
        owners = [j for j in range(first_shared) if types[j] == types[idx]]
        if not owners:
            raise ValueError(f"Gemma layer {idx} ({types[idx]}) has no earlier layer to share")
        targets[idx] = owners[-1]
    return targets


class SharedKVAttention(nn.Module):
    """q/k norms, unscaled value norm, rope, scale 1; KV-sharing layers only project queries.

    Every layer has the config's head size and KV heads, and caches K and V; a subclass may
    give layers shapes of their own (`layer_shape`) or cache values alone (`caches_values_only`,
    the kernel then rebuilding keys through `key_from_value_source`).
    """

    def __init__(
        self, hf_config: PretrainedConfig, idx: int, target: int | None, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        hidden, eps, bias = hf_config.hidden_size, hf_config.rms_norm_eps, hf_config.attention_bias
        self.head_size, kv_heads = self.layer_shape(hf_config, idx)
        size, heads = self.head_size, hf_config.num_attention_heads
        self.eps, self.is_shared = eps, target is not None
        self.keys_from_values = self.caches_values_only(hf_config, idx)
        self.q_norm = RMSNorm(size, eps)
        if target is None:
            self.qkv_proj = QKVParallelLinear(
                hidden, size, heads, kv_heads, parallel, bias, with_value=not self.keys_from_values
            )
            self.k_norm = RMSNorm(size, eps)
        else:  # NOTE: the checkpoint's `q_proj` is renamed here (see `SharedKVForCausalLM`)
            self.query_proj = ColumnParallelLinear(hidden, heads * size, parallel, bias=bias)
        self.o_proj = RowParallelLinear(heads * size, hidden, parallel, bias=bias)
        self.attn = Attention(
            AttentionConfig(
                layer_name=attention_layer_name(idx),
                num_heads=heads // parallel.tp_size,
                num_kv_heads=max(1, kv_heads // parallel.tp_size),  # as QKVParallelLinear does
                total_num_kv_heads=kv_heads,
                head_size=size,
                scale=1.0,
                sliding_window=window_from_layer_types(hf_config, idx),
                kv_sharing_target=None if target is None else attention_layer_name(target),
                keys_from_values=self.keys_from_values,
                bidirectional_images=self.bidirectional_images_in_layer(hf_config, idx),
            )
        )

    @staticmethod
    def layer_shape(hf_config: PretrainedConfig, idx: int) -> tuple[int, int]:
        """(head size, KV heads) of layer `idx`."""
        return int(hf_config.head_dim), int(hf_config.num_key_value_heads)

    @staticmethod
    def caches_values_only(hf_config: PretrainedConfig, idx: int) -> bool:
        """Whether layer `idx` caches V alone and the kernel rebuilds K from it."""
        return False

    @staticmethod
    def bidirectional_images_in_layer(hf_config: PretrainedConfig, idx: int) -> bool:
        """Whether layer `idx` lets an image's tokens attend to each other both ways (when the
        model's images do: `AttentionConfig.bidirectional_images`)."""
        return True

    def key_from_value_source(self) -> KeyFromValue | None:
        """How the kernel rebuilds this layer's keys from its cached values (None: cached keys)."""
        return None

    def forward(self, x: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        num_tokens, size = x.shape[0], self.head_size
        if self.is_shared:
            q, k, v = self.query_proj(x), x.new_empty(0), x.new_empty(0)
        else:
            q, k, v = self.qkv_proj.split(self.qkv_proj(x))
            v = unscaled_rms(v.reshape(num_tokens, -1, size), self.eps)
            if not self.keys_from_values:  # else the kernel rebuilds the keys from v
                k = apply_rotary(self.k_norm(k.reshape(num_tokens, -1, size)), rope)
        q = apply_rotary(self.q_norm(q.reshape(num_tokens, -1, size)), rope)
        out = self.attn(
            q.reshape(num_tokens, -1),
            k.reshape(num_tokens, -1),
            v.reshape(num_tokens, -1),
            ctx,
            key_from_value=self.key_from_value_source(),
        )
        projected: torch.Tensor = self.o_proj(out)
        return projected


class SharedKVForCausalLM(DecoderForCausalLM):
    """Base of the Gemma 3n and Gemma 4 causal LMs: their traits and their KV-sharing layers'
    weights."""

    tie_word_embeddings_default = True

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        super().__init__(model_config, parallel)
        self.shared_layers = set(kv_sharing_targets(model_config.hf_config))

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        cap = getattr(hf_config, "final_logit_softcapping", None)
        return DecoderOptions(
            hidden_act=hf_config.hidden_activation,
            attn_scale=1.0,
            final_softcap=float(cap) if cap is not None else None,
        )

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Shared layers' `q_proj` loads into `query_proj`; their K/V tensors are not loaded."""
        shared = [f"{layer_prefix(idx)}self_attn." for idx in sorted(self.shared_layers)]
        skip = [f"{prefix}{part}." for prefix in shared for part in _SHARED_LAYER_SKIPS]
        if self.tie_word_embeddings:
            skip.append("lm_head.")
        queries = tuple(f"{prefix}q_proj." for prefix in shared)
        renamed = read_kv_scales(self, _renamed(weights, queries))
        return load_named_weights(self, renamed, skip_prefixes=skip)


def _renamed(
    weights: Iterable[tuple[str, WeightSource]], queries: tuple[str, ...]
) -> Iterator[tuple[str, WeightSource]]:
    for name, weight in weights:
        if name.startswith(queries):
            name = name.replace(".q_proj.", ".query_proj.")
        yield name, weight

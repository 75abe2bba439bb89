"""Llama 4 (text): chunked local attention, NoPE layers, MoE with a shared expert.

Layers listed as `chunked_attention` attend within chunks of `attention_chunk_size` tokens (the
runner cuts them into virtual requests); NoPE layers (`no_rope_layers[i] == 0`) skip rope and,
with `attn_temperature_tuning`, scale queries by `1 + attn_scale * log1p(floor((p + 1) /
floor_scale))`; rope layers may L2-normalize q and k (`use_qk_norm`). Rope rotates adjacent
pairs (complex form). MoE layers route each token to its top-k experts, scaling the expert's
input by sigmoid(router logit), and add a shared expert. The optional extra config key
`kv_sharing_targets` (`{"7": 5}`) makes layers read an earlier layer's KV.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from worker.attention.attention import Attention, AttentionConfig, ForwardContext
from worker.config import ParallelConfig
from worker.decoder_loop import DecoderLayerLoop
from worker.kv_sharing import kv_sharing_targets_from_config
from worker.layers.embedding import VocabParallelEmbedding
from worker.layers.linear import QKVParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RopeTables, RotaryEmbedding, rope_parameters
from worker.models.decoder import (
    DecoderForCausalLM,
    DecoderOptions,
    attention_layer_name,
    head_size_of,
)
from worker.models.llama4_moe import Llama4MLP, Llama4MoE

Inputs = tuple[torch.Tensor, RopeTables]
"""Per-token layer inputs: positions [T] and the rope tables."""


def _rotate_pairs(x: torch.Tensor, rope: RopeTables) -> torch.Tensor:
    """Rotate adjacent feature pairs of `x` [T, heads, D] (complex-multiply layout)."""
    half = x.shape[-1] // 2
    cos, sin = rope.cos[:, None, :half], rope.sin[:, None, :half]
    pairs = x.float().reshape(*x.shape[:-1], half, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(nn.Module):
    """Grouped-query attention with per-layer rope / NoPE, qk norm and temperature tuning."""

    def __init__(
        self, hf_config: PretrainedConfig, idx: int, target: int | None, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        hidden, self.head_size = hf_config.hidden_size, head_size_of(hf_config)
        heads, bias = hf_config.num_attention_heads, bool(hf_config.attention_bias)
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_size, heads, hf_config.num_key_value_heads, parallel, bias=bias
        )
        self.o_proj = RowParallelLinear(heads * self.head_size, hidden, parallel, bias=bias)
        self.use_rope = bool(hf_config.no_rope_layers[idx])
        self.use_qk_norm = bool(hf_config.use_qk_norm) and self.use_rope
        self.tune_temperature = bool(hf_config.attn_temperature_tuning) and not self.use_rope
        self.eps, self.floor_scale = hf_config.rms_norm_eps, hf_config.floor_scale
        self.temperature_scale = hf_config.attn_scale
        is_chunked = hf_config.layer_types[idx] == "chunked_attention"
        self.attn = Attention(
            AttentionConfig(
                layer_name=attention_layer_name(idx),
                num_heads=self.qkv_proj.num_heads,
                num_kv_heads=self.qkv_proj.num_kv_heads,
                total_num_kv_heads=hf_config.num_key_value_heads,
                head_size=self.head_size,
                scale=self.head_size**-0.5,
                attention_chunk_size=hf_config.attention_chunk_size if is_chunked else None,
                kv_sharing_target=None if target is None else attention_layer_name(target),
            )
        )

    def forward(self, x: torch.Tensor, inputs: Inputs, ctx: ForwardContext) -> torch.Tensor:
        positions, rope = inputs
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.reshape(num_tokens, -1, self.head_size)
        k = k.reshape(num_tokens, -1, self.head_size)
        if self.use_rope:
            q, k = _rotate_pairs(q, rope), _rotate_pairs(k, rope)
        if self.use_qk_norm:
            q, k = _l2_norm(q, self.eps), _l2_norm(k, self.eps)
        if self.tune_temperature:
            steps = torch.floor((positions.float() + 1.0) / self.floor_scale)
            scales = torch.log1p(steps) * self.temperature_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, ctx)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class Llama4DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + feed_forward(norm(.)) (MoE or dense)."""

    def __init__(
        self, hf_config: PretrainedConfig, idx: int, target: int | None, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = Llama4Attention(hf_config, idx, target, parallel)
        self.feed_forward: nn.Module
        if idx in hf_config.moe_layers:
            self.feed_forward = Llama4MoE(hf_config, parallel)
        else:
            inner = hf_config.intermediate_size_mlp
            self.feed_forward = Llama4MLP(hidden, inner, hf_config.hidden_act, parallel)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, inputs: Inputs, ctx: ForwardContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), inputs, ctx)
        out: torch.Tensor = hidden + self.feed_forward(self.post_attention_layernorm(hidden))
        return out


class Llama4Model(nn.Module):
    """Embedding, the layer stack (through the decoder layer loop) and the final norm."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        targets = kv_sharing_targets_from_config(hf_config)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden, parallel)
        self.layers = nn.ModuleList(
            Llama4DecoderLayer(hf_config, idx, targets.get(idx), parallel)
            for idx in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_size_of(hf_config), rope_parameters(hf_config))
        self.loop = DecoderLayerLoop(self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` [T, H] (images inserted) replace the lookup of `input_ids`."""

        def run_layer(idx: int, hidden: torch.Tensor, inputs: Inputs) -> torch.Tensor:
            out: torch.Tensor = self.layers[idx](hidden, inputs, ctx)
            return out

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        inputs: Inputs = (positions, self.rotary_emb(positions))
        hidden = self.loop.run(run_layer, inputs_embeds, inputs, ctx)
        normed: torch.Tensor = self.norm(hidden)
        return normed


class Llama4ForCausalLM(DecoderForCausalLM):
    """Llama 4 text-only causal LM (`Llama4ForCausalLM` / `Llama4TextConfig`)."""

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        return Llama4Model(hf_config, parallel)

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        scale = head_size_of(hf_config) ** -0.5
        return DecoderOptions(hidden_act=hf_config.hidden_act, attn_scale=scale)

"""Gemma 3n (text): cross-layer KV sharing, AltUp streams, LAuReL, per-layer inputs, sparsity.

The last `num_kv_shared_layers` layers own no KV: each reads the cache of the last earlier
layer of its own type (sliding or full). Hidden states are `altup_num_inputs` parallel streams,
kept tokens-first as `[T, streams, hidden]` so truncated prefill can gather rows on dim 0.
Numerics follow transformers' `Gemma3nTextModel` (fp32 norms, magnitude-matched streams).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from worker.attention.attention import ForwardContext
from worker.config import ParallelConfig
from worker.decoder_loop import DecoderLayerLoop
from worker.layers.embedding import VocabParallelEmbedding
from worker.layers.linear import ReplicatedLinear
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RopeTables, RotaryEmbedding, rope_parameters
from worker.models.gemma3n_layers import (
    AltUp,
    Gemma3nMLP,
    Laurel,
    PerLayerInputs,
    match_magnitude,
)
from worker.models.gemma_shared_kv import (
    SharedKVAttention,
    SharedKVForCausalLM,
    kv_sharing_targets,
)

Inputs = tuple[dict[str, RopeTables], torch.Tensor]
"""Per-token layer inputs: rope tables by layer type, per-layer inputs [T, layers, P]."""


class Gemma3nDecoderLayer(nn.Module):
    """AltUp predict -> attention + LAuReL + MLP on the active stream -> correct -> per-layer
    input added to the other streams."""

    def __init__(
        self, hf_config: PretrainedConfig, idx: int, target: int | None, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        per_layer = hf_config.hidden_size_per_layer_input
        self.self_attn = SharedKVAttention(hf_config, idx, target, parallel)
        self.mlp = Gemma3nMLP(hf_config, idx, parallel)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.altup, self.laurel = AltUp(hf_config), Laurel(hf_config)
        self.per_layer_input_gate = ReplicatedLinear(hidden, per_layer)
        self.per_layer_projection = ReplicatedLinear(per_layer, hidden)
        self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.act = ACT2FN[hf_config.hidden_activation]
        self.correct_scale = bool(hf_config.altup_correct_scale)

    def forward(
        self,
        streams: torch.Tensor,
        rope: RopeTables,
        per_layer_input: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        predictions = self.altup.predict(streams)
        active = predictions[:, self.altup.active]
        normed = self.input_layernorm(active)
        attn = self.post_attention_layernorm(self.self_attn(normed, rope, ctx))
        hidden = (active + attn + self.laurel(normed)) / math.sqrt(2)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = hidden + self.post_feedforward_layernorm(mlp_out)
        corrected = self.altup.correct(predictions, hidden)
        first = corrected[:, self.altup.active]
        if self.correct_scale:
            first = (first * self.altup.correct_output_scale).type_as(first)
        first = self.act(self.per_layer_input_gate(first)) * per_layer_input
        first = self.post_per_layer_input_norm(self.per_layer_projection(first))
        return torch.cat([corrected[:, :1], corrected[:, 1:] + first[:, None]], dim=1)


class Gemma3nModel(PerLayerInputs):
    """Embeddings, per-layer inputs, AltUp streams, the layer stack and the final norm."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        hidden, num_layers = hf_config.hidden_size, hf_config.num_hidden_layers
        self.types = list(hf_config.layer_types)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden, parallel)
        self.build_per_layer_inputs(hf_config, parallel)
        extra = range(1, hf_config.altup_num_inputs)
        self.altup_projections = nn.ModuleList(ReplicatedLinear(hidden, hidden) for _ in extra)
        self.altup_unembed_projections = nn.ModuleList(
            ReplicatedLinear(hidden, hidden) for _ in extra
        )
        targets = kv_sharing_targets(hf_config)
        self.layers = nn.ModuleList(
            Gemma3nDecoderLayer(hf_config, idx, targets.get(idx), parallel)
            for idx in range(num_layers)
        )
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps)
        self.rotary_emb = nn.ModuleDict(
            {
                kind: RotaryEmbedding(hf_config.head_dim, rope_parameters(hf_config, kind))
                for kind in sorted(set(self.types))
            }
        )
        self.loop = DecoderLayerLoop(self.layers)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        summed = self.sum_per_layer_inputs(input_ids, embeds)
        return summed * torch.rsqrt(torch.tensor(2.0)).to(embeds.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        embeds = embeds * torch.tensor(embeds.shape[-1] ** 0.5).to(embeds.dtype)  # [T, H]
        target = torch.mean(embeds**2, dim=-1, keepdim=True) ** 0.5
        extra = [match_magnitude(proj(embeds), target) for proj in self.altup_projections]
        streams = torch.stack([embeds, *extra], dim=1)  # [T, S, H]
        tables = {kind: rope(positions) for kind, rope in self.rotary_emb.items()}
        inputs: Inputs = (tables, self._per_layer_inputs(input_ids, embeds))

        def run_layer(idx: int, hidden: torch.Tensor, layer_inputs: Inputs) -> torch.Tensor:
            rope, per_layer = layer_inputs[0][self.types[idx]], layer_inputs[1][:, idx]
            out: torch.Tensor = self.layers[idx](hidden, rope, per_layer, ctx)
            return out

        streams = self.loop.run(run_layer, streams, inputs, ctx)
        target = torch.mean(streams[:, 0] ** 2, dim=-1, keepdim=True) ** 0.5
        unembedded = [streams[:, 0]] + [
            match_magnitude(proj(streams[:, idx + 1]), target)
            for idx, proj in enumerate(self.altup_unembed_projections)
        ]
        normed: torch.Tensor = self.norm(torch.stack(unembedded, dim=1).mean(dim=1))
        return normed


class Gemma3nForCausalLM(SharedKVForCausalLM):
    """Gemma 3n text-only causal LM (`Gemma3nForCausalLM` / `Gemma3nTextConfig`)."""

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        return Gemma3nModel(hf_config, parallel)

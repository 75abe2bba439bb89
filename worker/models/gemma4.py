"""Gemma 4 (text): sliding and global layers with their own head sizes, KV heads and rope,
K = V on global layers, KV sharing of the last layers, per-layer inputs and an optional MoE.

Sliding layers attend within `sliding_window` with the sliding head size; global layers use
`per_layer_config` (a larger head, fewer KV heads, "proportional" rope rotating a fraction of
the features). With `attention_k_eq_v` global layers have no value projection and cache one
tensor, from which the kernel rebuilds the keys (see `Gemma4Attention`). The last
`num_kv_shared_layers` layers own no KV (see `worker.models.gemma_shared_kv`). With
`enable_moe_block` each layer adds a routed-expert branch beside the dense MLP. Numerics follow
transformers' `Gemma4TextModel` (norms scale by w, not 1 + w; attention scale 1; a learned layer
scalar).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from worker.attention.attention import ForwardContext
from worker.config import ModelConfig, ParallelConfig
from worker.decoder_loop import DecoderLayerLoop
from worker.layers.embedding import VocabParallelEmbedding
from worker.layers.linear import ReplicatedLinear
from worker.layers.loading import default_weight_loader, new_parameter
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RopeTables, RotaryEmbedding, rope_parameters
from worker.models.gemma3n_layers import PerLayerInputs
from worker.models.gemma4_layers import Gemma4Attention, Gemma4Experts, Gemma4Router
from worker.models.gemma_shared_kv import SharedKVForCausalLM, kv_sharing_targets
from worker.models.llama4_moe import Llama4MLP

Inputs = tuple[dict[str, RopeTables], torch.Tensor]
"""Per-token layer inputs: rope tables by layer type, per-layer inputs [T, layers, P] (P = 0
when the model has none)."""


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP (+ MoE branch), per-layer input, layer scalar."""

    def __init__(
        self, hf_config: PretrainedConfig, idx: int, target: int | None, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        wide = bool(getattr(hf_config, "use_double_wide_mlp", False)) and target is not None
        inner = hf_config.intermediate_size * (2 if wide else 1)
        self.self_attn = Gemma4Attention(hf_config, idx, target, parallel)
        self.mlp = Llama4MLP(hidden, inner, hf_config.hidden_activation, parallel)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.has_moe = bool(hf_config.enable_moe_block)
        if self.has_moe:  # the routed branch, beside the MLP
            self.router = Gemma4Router(hf_config)
            self.experts = Gemma4Experts(hf_config, parallel)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.per_layer = int(hf_config.hidden_size_per_layer_input or 0)
        if self.per_layer:
            self.act = ACT2FN[hf_config.hidden_activation]
            self.per_layer_input_gate = ReplicatedLinear(hidden, self.per_layer)
            self.per_layer_projection = ReplicatedLinear(self.per_layer, hidden)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.layer_scalar = new_parameter((1,), default_weight_loader, fill=1.0)

    def _feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """MLP of the normed residual, plus (MoE) experts routed from the residual itself."""
        out: torch.Tensor = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.has_moe:
            weights, chosen = self.router(hidden)
            routed = self.experts(self.pre_feedforward_layernorm_2(hidden), weights, chosen)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        normed: torch.Tensor = self.post_feedforward_layernorm(out)
        return normed

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RopeTables,
        per_layer_input: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), rope, ctx)
        hidden = hidden + self.post_attention_layernorm(attn)
        hidden = hidden + self._feed_forward(hidden)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


class Gemma4Model(PerLayerInputs):
    """Embeddings, per-layer inputs, the layer stack (through the decoder loop), final norm."""

    def __init__(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        hidden, num_layers = hf_config.hidden_size, hf_config.num_hidden_layers
        self.types = list(hf_config.layer_types)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden, parallel)
        self.per_layer = int(hf_config.hidden_size_per_layer_input or 0)
        if self.per_layer:
            self.build_per_layer_inputs(hf_config, parallel)
        targets = kv_sharing_targets(hf_config)
        layers = [
            Gemma4DecoderLayer(hf_config, idx, targets.get(idx), parallel)
            for idx in range(num_layers)
        ]
        for idx, target in targets.items():
            if Gemma4Attention.caches_values_only(hf_config, idx):
                layers[idx].self_attn.read_keys_of(layers[target].self_attn)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps)
        head_sizes = {
            kind: Gemma4Attention.layer_shape(hf_config, self.types.index(kind))[0]
            for kind in self.types
        }
        self.rotary_emb = nn.ModuleDict(
            {
                kind: RotaryEmbedding(size, rope_parameters(hf_config, kind))
                for kind, size in sorted(head_sizes.items())
            }
        )
        self.loop = DecoderLayerLoop(self.layers)

    def _per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        scaled: torch.Tensor = self.sum_per_layer_inputs(input_ids, embeds) * 2.0**-0.5
        return scaled

    @staticmethod
    def scale_embeddings(embeds: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, H] times sqrt(H), rounded to their dtype as transformers does."""
        scaled: torch.Tensor = embeds * torch.tensor(embeds.shape[-1] ** 0.5).to(embeds.dtype)
        return scaled

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` (already scaled, images inserted) replace the lookup of `input_ids`,
        which still key the per-layer token table."""
        if inputs_embeds is None:
            inputs_embeds = self.scale_embeddings(self.embed_tokens(input_ids))
        embeds = inputs_embeds  # [T, H]
        tables = {kind: rope(positions) for kind, rope in self.rotary_emb.items()}
        if self.per_layer:
            per_layer = self._per_layer_inputs(input_ids, embeds)
        else:
            per_layer = embeds.new_empty((embeds.shape[0], 0, 0))
        inputs: Inputs = (tables, per_layer)

        def run_layer(idx: int, hidden: torch.Tensor, layer_inputs: Inputs) -> torch.Tensor:
            rope, per_layer = layer_inputs[0][self.types[idx]], layer_inputs[1]
            layer_input = per_layer[:, idx] if self.per_layer else None
            out: torch.Tensor = self.layers[idx](hidden, rope, layer_input, ctx)
            return out

        hidden = self.loop.run(run_layer, embeds, inputs, ctx)
        normed: torch.Tensor = self.norm(hidden)
        return normed


class Gemma4ForCausalLM(SharedKVForCausalLM):
    """Gemma 4 text-only causal LM (`Gemma4ForCausalLM` / `Gemma4TextConfig`)."""

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        hf_config = model_config.hf_config
        if getattr(hf_config, "use_bidirectional_attention", None) == "all":
            raise ValueError("Gemma 4 with bidirectional attention cannot be served as a decoder")
        # "vision" makes only image tokens attend bidirectionally: text serving is causal.
        super().__init__(model_config, parallel)

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        return Gemma4Model(hf_config, parallel)

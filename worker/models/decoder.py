"""The decoder-only transformer shared by every family: attention, MLP, layer, model, LM.

A family file subclasses `DecoderForCausalLM` and describes itself through hooks:
`decoder_options` (traits such as norm style, biases, softcaps, attention sinks),
`layer_options` (each layer's sliding window and rope table) and `build_mlp` (the feed-forward
block of a layer, a gated MLP unless the family routes to experts). Parameter names follow
transformers, except the packed `qkv_proj` and `gate_up_proj`, so checkpoints load by name.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import nn
from transformers import PretrainedConfig

from worker.attention.attention import Attention, AttentionConfig, ForwardContext
from worker.attention.kv_scales import read_kv_scales
from worker.config import ModelConfig, ParallelConfig
from worker.decoder_loop import DecoderLayerLoop
from worker.kv_sharing import kv_sharing_targets_from_config
from worker.layers.activation import gated_activation
from worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker.layers.loading import ShardId, WeightSource, copy_checked, new_parameter, read_part
from worker.layers.norm import RMSNorm, layer_kernels
from worker.layers.rotary import RopeTables, RotaryEmbedding, rope_parameters, rotate_in_place
from worker.weights import load_named_weights

DEFAULT_ROPE = "default"


@dataclass(frozen=True)
class DecoderOptions:
    """Traits of one model family (what differs between Llama, Qwen2, Gemma, ...)."""

    hidden_act: str
    """transformers activation name of the gated MLP."""
    attn_scale: float
    """Multiplier of q.k scores."""
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gemma_norm: bool = False
    """RMSNorm scales by (1 + w) in fp32 instead of by w."""
    sandwich_norm: bool = False
    """Norms after attention and around the MLP (Gemma 2/3) instead of one pre-MLP norm."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before rope."""
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None
    """Multiplier of token embeddings (Gemma: sqrt(hidden_size))."""
    attention_sinks: bool = False
    """Each attention layer has learned per-head sink logits `self_attn.sinks` (gpt-oss)."""


@dataclass(frozen=True)
class LayerOptions:
    """What one layer's attention does differently from its neighbours."""

    sliding_window: int | None = None
    rope: str = DEFAULT_ROPE
    """Key of the rotary table the layer uses."""
    kv_sharing_target: int | None = None
    """Earlier layer whose KV cache this layer reads (config key `kv_sharing_targets`)."""


def layer_prefix(layer_idx: int) -> str:
    """The name prefix of decoder layer `layer_idx`'s modules and checkpoint tensors."""
    return f"model.layers.{layer_idx}."


def attention_layer_name(layer_idx: int) -> str:
    """The name of decoder layer `layer_idx`'s paged attention layer: the key of its KV cache
    spec, of its attention group and of the layers that share its KV cache."""
    return f"{layer_prefix(layer_idx)}self_attn.attn"


def head_size_of(hf_config: PretrainedConfig) -> int:
    """`head_dim` when the config sets it, else hidden_size / num_attention_heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


class DecoderAttention(nn.Module):
    """Self-attention: packed qkv projection, optional qk norm, rope, paged attention, o_proj."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        options: DecoderOptions,
        layer: LayerOptions,
        layer_idx: int,
        parallel: ParallelConfig,
    ) -> None:
        super().__init__()
        hidden, head_size = hf_config.hidden_size, head_size_of(hf_config)
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, head_size, num_heads, num_kv_heads, parallel, bias=options.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            num_heads * head_size, hidden, parallel, bias=options.o_bias
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if options.qk_norm:
            eps = hf_config.rms_norm_eps
            self.q_norm = RMSNorm(head_size, eps, add_unit_offset=options.gemma_norm)
            self.k_norm = RMSNorm(head_size, eps, add_unit_offset=options.gemma_norm)
        self.attn = Attention(
            AttentionConfig(
                layer_name=attention_layer_name(layer_idx),
                num_heads=self.qkv_proj.num_heads,
                num_kv_heads=self.qkv_proj.num_kv_heads,
                total_num_kv_heads=num_kv_heads,
                head_size=head_size,
                scale=options.attn_scale,
                sliding_window=layer.sliding_window,
                logits_softcap=options.attn_softcap,
                kv_sharing_target=(
                    None
                    if layer.kv_sharing_target is None
                    else attention_layer_name(layer.kv_sharing_target)
                ),
                has_sinks=options.attention_sinks,
            )
        )
        self.kernels = layer_kernels()
        self.sinks: nn.Parameter | None = None
        if options.attention_sinks:
            self.rank = parallel.rank
            self.sinks = new_parameter((self.qkv_proj.num_heads,), self.load_sinks)

    def load_sinks(self, param: nn.Parameter, source: WeightSource, _: ShardId = None) -> None:
        """This rank's query heads' sink logits."""
        size = param.shape[0]
        copy_checked(param.data, read_part(source, 0, self.rank * size, size))

    def forward(self, hidden: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        num_tokens, head_size = hidden.shape[0], self.qkv_proj.head_size
        qkv = self.qkv_proj(hidden)
        q, k, v = self.qkv_proj.split(qkv)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.view(num_tokens, -1, head_size))  # [T, num_heads, head_size]
            k = self.k_norm(k.view(num_tokens, -1, head_size))  # [T, num_kv_heads, head_size]
            rotate_in_place(q, rope, self.kernels)
            rotate_in_place(k, rope, self.kernels)
        else:  # queries and keys are adjacent in qkv: one rotation of both, in place
            num_qk = self.qkv_proj.num_heads + self.qkv_proj.num_kv_heads
            rotate_in_place(qkv[:, : num_qk * head_size].view(num_tokens, num_qk, head_size),
                            rope, self.kernels)  # fmt: skip
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v, ctx, self.sinks)
        projected: torch.Tensor = self.o_proj(out)
        return projected


class DecoderMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)) with gate and up in one matmul."""

    def __init__(
        self, hf_config: PretrainedConfig, options: DecoderOptions, parallel: ParallelConfig
    ) -> None:
        super().__init__()
        hidden, inner = hf_config.hidden_size, hf_config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [inner, inner], parallel, bias=options.mlp_bias
        )
        self.act = gated_activation(options.hidden_act)
        self.down_proj = RowParallelLinear(inner, hidden, parallel, bias=options.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act(self.gate_up_proj(x)))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); sandwich norms when asked."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        options: DecoderOptions,
        layer: LayerOptions,
        layer_idx: int,
        parallel: ParallelConfig,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        hidden, eps, gemma = hf_config.hidden_size, hf_config.rms_norm_eps, options.gemma_norm
        self.self_attn = DecoderAttention(hf_config, options, layer, layer_idx, parallel)
        self.mlp = mlp if mlp is not None else DecoderMLP(hf_config, options, parallel)
        self.input_layernorm = RMSNorm(hidden, eps, add_unit_offset=gemma)
        self.post_attention_layernorm = RMSNorm(hidden, eps, add_unit_offset=gemma)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if options.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(hidden, eps, add_unit_offset=gemma)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, add_unit_offset=gemma)

    def forward(self, hidden: torch.Tensor, rope: RopeTables, ctx: ForwardContext) -> torch.Tensor:
        attn_out: torch.Tensor = self.self_attn(self.input_layernorm(hidden), rope, ctx)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            normed, hidden = self.post_attention_layernorm.add_and_norm(attn_out, hidden)
            mlp_out: torch.Tensor = self.mlp(normed)
            return hidden + mlp_out
        attn_out = self.post_attention_layernorm(attn_out)
        normed, hidden = self.pre_feedforward_layernorm.add_and_norm(attn_out, hidden)
        mlp_out = self.post_feedforward_layernorm(self.mlp(normed))
        return hidden + mlp_out


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (transformers' `model.` prefix)."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        options: DecoderOptions,
        layers: list[LayerOptions],
        ropes: dict[str, dict[str, object]],
        parallel: ParallelConfig,
        mlps: list[nn.Module | None] | None = None,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed_scale = options.embed_scale
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hidden, parallel)
        mlps = mlps if mlps is not None else [None] * len(layers)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, options, layer, idx, parallel, mlps[idx])
            for idx, layer in enumerate(layers)
        )
        self.layer_ropes = [layer.rope for layer in layers]
        self.norm = RMSNorm(hidden, hf_config.rms_norm_eps, add_unit_offset=options.gemma_norm)
        head_size = head_size_of(hf_config)
        self.rotary_emb = nn.ModuleDict(
            {key: RotaryEmbedding(head_size, params) for key, params in ropes.items()}
        )
        self.loop = DecoderLayerLoop(self.layers)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: token embeddings, scaled as the family does (Gemma)."""
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` [T, hidden]: the layers' input as given (images merged in)."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        tables = {key: rope(positions) for key, rope in self.rotary_emb.items()}

        def run_layer(idx: int, hidden: torch.Tensor, rope: dict[str, RopeTables]) -> torch.Tensor:
            out: torch.Tensor = self.layers[idx](hidden, rope[self.layer_ropes[idx]], ctx)
            return out

        hidden = self.loop.run(run_layer, hidden, tables, ctx)
        normed: torch.Tensor = self.norm(hidden)
        return normed


class DecoderForCausalLM(nn.Module, abc.ABC):
    """A causal LM with the runner's interface: forward, compute_logits, load_weights."""

    tie_word_embeddings_default = False
    """Whether the LM head reuses the embedding when the config does not say."""

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        super().__init__()
        hf_config = model_config.hf_config
        self.options = self.decoder_options(hf_config)
        self.model = self.build_model(hf_config, parallel)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, parallel)
        self.tie_word_embeddings = bool(
            getattr(hf_config, "tie_word_embeddings", self.tie_word_embeddings_default)
        )
        if self.tie_word_embeddings:
            embedding = self.model.embed_tokens
            assert isinstance(embedding, VocabParallelEmbedding)
            self.lm_head.tie_to(embedding)

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        """The decoder stack (embedding, layers, final norm); the shared stack by default."""
        targets = kv_sharing_targets_from_config(hf_config)
        layers = [
            replace(self.layer_options(hf_config, i), kv_sharing_target=targets.get(i))
            for i in range(hf_config.num_hidden_layers)
        ]
        mlps = [self.build_mlp(hf_config, i, parallel) for i in range(len(layers))]
        ropes = self.rope_tables(hf_config)
        return DecoderModel(hf_config, self.options, layers, ropes, parallel, mlps)

    @classmethod
    @abc.abstractmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        """The family's traits."""

    def layer_options(self, hf_config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        """Layer `layer_idx`'s window and rope table; full attention and one rope by default."""
        return LayerOptions()

    def rope_tables(self, hf_config: PretrainedConfig) -> dict[str, dict[str, object]]:
        """Rope parameters by table key; one table by default."""
        return {DEFAULT_ROPE: rope_parameters(hf_config)}

    def build_mlp(
        self, hf_config: PretrainedConfig, layer_idx: int, parallel: ParallelConfig
    ) -> nn.Module | None:
        """Layer `layer_idx`'s feed-forward block; None: the shared gated `DecoderMLP`."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] token ids and positions -> final hidden states [T, hidden_size]; with
        `inputs_embeds` [T, hidden_size] the embedding lookup is skipped (`worker.multimodal`)."""
        if inputs_embeds is None:
            hidden: torch.Tensor = self.model(input_ids, positions, ctx)
        else:
            hidden = self.model(input_ids, positions, ctx, inputs_embeds)
        return hidden

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden_size]: the token embeddings the forward would compute."""
        embeds: torch.Tensor = self.model.embed_input_ids(input_ids)  # type: ignore[operator]
        return embeds

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 [N, vocab], full vocabulary on every rank, final softcap applied."""
        logits = self.lm_head.compute_logits(hidden).float()
        cap = self.options.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the names of the parameters filled (fp8
        KV scales, when the checkpoint has them, go to the attention layers' buffers)."""
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        return load_named_weights(self, read_kv_scales(self, weights), skip_prefixes=skip)


def window_from_layer_types(hf_config: PretrainedConfig, layer_idx: int) -> int | None:
    """The sliding window of layer `layer_idx` per the config's `layer_types` (None: full)."""
    layer_types = getattr(hf_config, "layer_types", None)
    if not layer_types:
        return None
    layer_type = layer_types[layer_idx]
    if layer_type == "full_attention":
        return None
    if layer_type == "sliding_attention":
        window = getattr(hf_config, "sliding_window", None)
        return int(window) if window is not None else None
    raise ValueError(f"layer {layer_idx} has layer type {layer_type!r}, which is not supported")

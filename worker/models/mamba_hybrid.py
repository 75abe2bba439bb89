"""The hybrid Mamba-2 / attention decoder shared by Bamba, GraniteMoeHybrid and NemotronH.

Every layer is: x + m * mixer(norm(x)) [+ m * ffn(ffn_norm(x))], where the mixer is a Mamba-2
mixer, attention (the shared `DecoderAttention`, rope optional) or nothing, the ffn is a
family's MLP or MoE or nothing, and m the residual multiplier (Granite; 1 elsewhere). A family
describes its layers with `HybridLayerSpec`s and maps its checkpoint names onto ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from worker.attention.attention import ForwardContext
from worker.config import ParallelConfig
from worker.layers.embedding import VocabParallelEmbedding
from worker.layers.loading import WeightSource
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RopeTables, RotaryEmbedding, rotate_in_place
from worker.models.decoder import DecoderAttention, DecoderForCausalLM, layer_prefix
from worker.state.mamba import MambaConfig, MambaMixer2

MAMBA = "mamba"
ATTENTION = "attention"


class HybridAttention(DecoderAttention):
    """`DecoderAttention` whose rope is optional (NoPE layers of NemotronH and Granite)."""

    def forward(
        self, hidden: torch.Tensor, rope: RopeTables | None, ctx: ForwardContext
    ) -> torch.Tensor:
        head_size = self.qkv_proj.head_size
        qkv = self.qkv_proj(hidden)
        if rope is not None:  # queries and keys are adjacent in qkv: one rotation, in place
            num_qk = self.qkv_proj.num_heads + self.qkv_proj.num_kv_heads
            qk = qkv[:, : num_qk * head_size].view(hidden.shape[0], num_qk, head_size)
            rotate_in_place(qk, rope, self.kernels)
        q, k, v = self.qkv_proj.split(qkv)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, ctx))
        return out


@dataclass(frozen=True)
class HybridLayerSpec:
    """What one layer holds, under which checkpoint names."""

    kind: str
    """MAMBA, ATTENTION or another family-defined kind (then `mixer` builds it)."""
    mixer_name: str
    """Attribute (checkpoint) name of the mixer: "mamba", "self_attn", "mixer"."""
    norm_name: str
    ffn_name: str | None = None
    ffn_norm_name: str | None = None

    @classmethod
    def state_or_attention(
        cls, has_state: bool, state_mixer: str, norm: str, ffn: str, ffn_norm: str
    ) -> HybridLayerSpec:
        """A layer holding a state mixer named `state_mixer` (MAMBA kind) when `has_state`,
        else attention named `self_attn`; the other names are the same either way."""
        if has_state:
            return cls(MAMBA, state_mixer, norm, ffn, ffn_norm)
        return cls(ATTENTION, "self_attn", norm, ffn, ffn_norm)


def mamba_config(hf_config: PretrainedConfig, layer_idx: int, **sizes: object) -> MambaConfig:
    """A `MambaConfig` for layer `layer_idx`: the sizes given, named as in `MambaConfig`."""
    return MambaConfig(layer_name=f"{layer_prefix(layer_idx)}mamba", **sizes)  # type: ignore[arg-type]


class HybridLayer(nn.Module):
    """norm -> mixer -> residual, then optionally ffn_norm -> ffn -> residual."""

    def __init__(
        self, spec: HybridLayerSpec, modules: dict[str, nn.Module], residual_multiplier: float
    ) -> None:
        super().__init__()
        self.spec = spec
        self.multiplier = residual_multiplier
        for name, module in modules.items():
            self.add_module(name, module)

    def forward(
        self, hidden: torch.Tensor, rope: RopeTables | None, ctx: ForwardContext
    ) -> torch.Tensor:
        spec = self.spec
        normed = getattr(self, spec.norm_name)(hidden)
        mixer = getattr(self, spec.mixer_name)
        if spec.kind == MAMBA:
            out = mixer(normed, ctx)
        elif spec.kind == ATTENTION:
            out = mixer(normed, rope, ctx)
        else:
            out = mixer(normed)
        if self.multiplier != 1:
            out = out * self.multiplier
        if spec.ffn_name is None or spec.ffn_norm_name is None:
            mixed: torch.Tensor = hidden + out
            return mixed
        ffn_norm = getattr(self, spec.ffn_norm_name)
        if isinstance(ffn_norm, RMSNorm):
            normed, hidden = ffn_norm.add_and_norm(out, hidden)
        else:
            hidden = hidden + out
            normed = ffn_norm(hidden)
        ffn_out = getattr(self, spec.ffn_name)(normed)
        if self.multiplier != 1:
            ffn_out = ffn_out * self.multiplier
        result: torch.Tensor = hidden + ffn_out
        return result


class HybridModel(nn.Module):
    """Embedding (times a multiplier), the hybrid layers, the final norm."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        layers: list[HybridLayer],
        parallel: ParallelConfig,
        rotary: RotaryEmbedding | None,
        eps: float,
        embedding_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, parallel
        )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hf_config.hidden_size, eps)
        self.rotary_emb = rotary
        self.embedding_multiplier = embedding_multiplier

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: token embeddings times the embedding multiplier."""
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1:
            hidden = hidden * self.embedding_multiplier
        return hidden

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` [T, hidden] (images merged in) replaces `embed_input_ids`."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary_emb(positions) if self.rotary_emb is not None else None
        for layer in self.layers:
            hidden = layer(hidden, rope, ctx)
        normed: torch.Tensor = self.norm(hidden)
        return normed


class HybridForCausalLM(DecoderForCausalLM):
    """Base of the hybrid families: checkpoint names are renamed before loading."""

    renames: tuple[tuple[str, str], ...] = ()
    """(checkpoint substring, ours) replacements, applied in order."""
    logits_divisor: float = 1.0

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, WeightSource]]:
            for name, source in weights:
                for old, new in self.renames:
                    name = name.replace(old, new)
                yield name, source

        return super().load_weights(renamed())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits / self.logits_divisor if self.logits_divisor != 1 else logits


def build_layers(
    specs: list[HybridLayerSpec],
    make_modules: Callable[[int, HybridLayerSpec], dict[str, nn.Module]],
    residual_multiplier: float = 1.0,
) -> list[HybridLayer]:
    """One `HybridLayer` per spec, its modules from the family's `make_modules`."""
    return [
        HybridLayer(spec, make_modules(idx, spec), residual_multiplier)
        for idx, spec in enumerate(specs)
    ]


def build_mamba(
    hf_config: PretrainedConfig, idx: int, sizes: dict[str, object], parallel: ParallelConfig
) -> MambaMixer2:
    """A Mamba-2 mixer for layer `idx` with `sizes` (MambaConfig fields but the name)."""
    return MambaMixer2(mamba_config(hf_config, idx, **sizes), parallel)


def time_step_limit(hf_config: PretrainedConfig) -> tuple[float, float]:
    limit = getattr(hf_config, "time_step_limit", None) or (0.0, math.inf)
    return (float(limit[0]), float(limit[1]))

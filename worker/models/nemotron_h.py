"""NemotronH (Nemotron-H, Nemotron Nano 2): Mamba-2, attention and MLP-only layers.

Each layer is one mixer between a pre-norm and a residual: Mamba-2 ("linear_attention", "M"),
attention without positional encoding ("full_attention", "*") or a non-gated relu^2 MLP
("mlp", "-"). Checkpoint names start with `backbone.`. MoE layers ("moe") are not supported.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from worker.config import ParallelConfig
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.layers.norm import RMSNorm
from worker.models.decoder import DecoderOptions, LayerOptions, head_size_of
from worker.models.mamba_hybrid import (
    ATTENTION,
    MAMBA,
    HybridAttention,
    HybridForCausalLM,
    HybridLayerSpec,
    HybridModel,
    build_layers,
    build_mamba,
)

MLP = "mlp"
_KINDS = {"linear_attention": MAMBA, "full_attention": ATTENTION, "mlp": MLP}


class NemotronHMLP(nn.Module):
    """down(relu(up(x))^2), no gate."""

    def __init__(self, hidden: int, inner: int, bias: bool, parallel: ParallelConfig) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(hidden, inner, parallel, bias=bias)
        self.down_proj = RowParallelLinear(inner, hidden, parallel, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(torch.square(F.relu(self.up(x))))
        return out


def nemotron_mamba_sizes(hf_config: PretrainedConfig) -> dict[str, object]:
    """MambaConfig sizes from NemotronH's keys (dt clamped below at `time_step_min`)."""
    return {
        "hidden_size": hf_config.hidden_size,
        "num_heads": hf_config.mamba_num_heads,
        "head_dim": hf_config.mamba_head_dim,
        "num_groups": hf_config.n_groups,
        "state_size": hf_config.ssm_state_size,
        "conv_width": hf_config.conv_kernel,
        "chunk_size": hf_config.chunk_size,
        "norm_eps": hf_config.layer_norm_epsilon,
        "conv_bias": bool(hf_config.use_conv_bias),
        "proj_bias": bool(hf_config.use_bias),
        "dt_limit": (float(hf_config.time_step_min), math.inf),
    }


class NemotronHForCausalLM(HybridForCausalLM):
    """transformers' `NemotronHForCausalLM` (Mamba-2 / attention / MLP layers)."""

    renames = (
        ("backbone.embeddings.", "model.embed_tokens."),
        ("backbone.norm_f.", "model.norm."),
        ("backbone.", "model."),
        (".mixer.up_proj.", ".mixer.up."),
    )

    @classmethod
    def decoder_options(cls, hf_config: PretrainedConfig) -> DecoderOptions:
        return DecoderOptions(
            hidden_act=hf_config.mlp_hidden_act,
            attn_scale=head_size_of(hf_config) ** -0.5,
            qkv_bias=bool(hf_config.attention_bias),
            o_bias=bool(hf_config.attention_bias),
        )

    def build_model(self, hf_config: PretrainedConfig, parallel: ParallelConfig) -> nn.Module:
        unknown = sorted(set(hf_config.layers_block_type) - set(_KINDS))
        if unknown:
            raise ValueError(f"NemotronH layer types {unknown} are not supported")
        specs = [
            HybridLayerSpec(_KINDS[kind], "mixer", "norm") for kind in hf_config.layers_block_type
        ]
        eps, hidden = hf_config.layer_norm_epsilon, hf_config.hidden_size

        def modules(idx: int, spec: HybridLayerSpec) -> dict[str, nn.Module]:
            mixer: nn.Module
            if spec.kind == ATTENTION:
                mixer = HybridAttention(hf_config, self.options, LayerOptions(), idx, parallel)
            elif spec.kind == MAMBA:
                mixer = build_mamba(hf_config, idx, nemotron_mamba_sizes(hf_config), parallel)
            else:
                mixer = NemotronHMLP(
                    hidden, hf_config.intermediate_size, bool(hf_config.mlp_bias), parallel
                )
            return {"norm": RMSNorm(hidden, eps), "mixer": mixer}

        layers = build_layers(specs, modules)
        return HybridModel(hf_config, layers, parallel, None, eps)

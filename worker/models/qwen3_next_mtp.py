"""The multi-token-prediction (MTP) layer of Qwen3-Next and Qwen3.5 checkpoints.

One more gated full-attention decoder layer, fed with the target's hidden state at position i
and the embedding of the token at i + 1; it predicts the token at i + 2 through the target's
LM head (embedding and LM head are the target's):

    x = fc([pre_fc_norm_embedding(embed(token i+1)) | pre_fc_norm_hidden(hidden i)])
    out = norm(decoder_layer(x))          (out also feeds the next MTP step as its hidden)

Checkpoint tensors (Hugging Face layout): `mtp.fc`, `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.layers.0.*` (as a decoder layer's), `mtp.norm`; the config says
`num_nextn_predict_layers` (Qwen3-Next) or `mtp_num_hidden_layers` (Qwen3.5).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from worker.attention.attention import ForwardContext
from worker.config import ModelConfig, ParallelConfig
from worker.layers.linear import ReplicatedLinear
from worker.layers.loading import WeightSource
from worker.layers.norm import RMSNorm
from worker.models.mamba_hybrid import ATTENTION, HybridLayer, HybridLayerSpec, HybridModel
from worker.models.qwen3_next import GatedAttention, Qwen3NextForCausalLM
from worker.models.qwen_next_moe import split_stacked_experts
from worker.weights import iterate_weights, load_named_weights

MTP_PREFIX = "mtp."
MTP_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)


def check_mtp_checkpoint(model_config: ModelConfig) -> None:
    """ValueError (one line) unless the checkpoint holds one MTP layer and its weights."""
    arch = model_config.architecture
    if arch not in MTP_ARCHITECTURES:
        raise ValueError(
            f"speculative_config method 'mtp': {arch} has no MTP layers (supported: "
            f"{', '.join(MTP_ARCHITECTURES)})"
        )
    hf_config = model_config.hf_config
    layers = getattr(hf_config, "num_nextn_predict_layers", None) or getattr(
        hf_config, "mtp_num_hidden_layers", None
    )
    has_weights = any(
        name.startswith(MTP_PREFIX) for name, _ in iterate_weights(model_config.model_path)
    )
    if not layers or not has_weights:
        raise ValueError(
            f"speculative_config method 'mtp': the checkpoint {model_config.model_path} has no "
            "MTP layers (num_nextn_predict_layers / mtp_num_hidden_layers and mtp.* weights)"
        )


class Qwen3NextMTP(nn.Module):
    """The MTP layer beside a loaded Qwen3-Next / Qwen3.5 target (sharing its embedding,
    rope and LM head)."""

    def __init__(
        self,
        target: Qwen3NextForCausalLM,
        model_config: ModelConfig,
        parallel: ParallelConfig | None = None,
    ) -> None:
        """`parallel`: this rank's share (the attention and FFN are sharded as the target's)."""
        super().__init__()
        hf_config = model_config.hf_config
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        parallel = parallel or ParallelConfig()
        self.fc = ReplicatedLinear(2 * hidden, hidden)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, add_unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, add_unit_offset=True)
        spec = HybridLayerSpec(
            ATTENTION, "self_attn", "input_layernorm", "mlp", "post_attention_layernorm"
        )
        layer_idx = hf_config.num_hidden_layers  # names its attention apart from the target's
        modules: dict[str, nn.Module] = {
            "input_layernorm": RMSNorm(hidden, eps, add_unit_offset=True),
            "self_attn": GatedAttention(hf_config, target.options, layer_idx, parallel),
            "post_attention_layernorm": RMSNorm(hidden, eps, add_unit_offset=True),
            "mlp": target.build_ffn(hf_config, 0, parallel),
        }
        self.layers = nn.ModuleList([HybridLayer(spec, modules, 1.0)])
        self.norm = RMSNorm(hidden, eps, add_unit_offset=True)
        self._target = (target,)
        """The target (a tuple: its parameters are not this module's)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """[T] ids of the tokens after `previous_hidden`'s [T, hidden] positions -> [T, hidden]."""
        model = self._target[0].model
        assert isinstance(model, HybridModel)
        embedded = self.pre_fc_norm_embedding(model.embed_tokens(input_ids))
        fused = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(previous_hidden)], dim=-1))
        rope = model.rotary_emb(positions) if model.rotary_emb is not None else None
        out: torch.Tensor = self.norm(self.layers[0](fused, rope, ctx))
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Load the checkpoint's `mtp.*` tensors (the others are the target's)."""
        mtp = (
            (name[len(MTP_PREFIX) :], source)
            for name, source in weights
            if name.startswith(MTP_PREFIX)
        )
        return load_named_weights(self, split_stacked_experts(mtp))


def load_mtp(
    target: nn.Module,
    model_config: ModelConfig,
    load_format: str,
    parallel: ParallelConfig | None = None,
) -> Qwen3NextMTP:
    """The MTP layer of `target`'s checkpoint, on the target's device and dtype (this rank's
    shard of it under `parallel`)."""
    if not isinstance(target, Qwen3NextForCausalLM):
        raise ValueError(f"speculative_config method 'mtp': {type(target).__name__} has no MTP")
    param = next(target.parameters())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(param.dtype)
    try:
        with param.device:
            mtp = Qwen3NextMTP(target, model_config, parallel)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        for weight in mtp.parameters():
            weight.data.uniform_(-1e-3, 1e-3)
        return mtp.eval()
    loaded = mtp.load_weights(iterate_weights(Path(model_config.model_path)))
    missing = sorted(name for name, _ in mtp.named_parameters() if name not in loaded)
    if missing:
        raise ValueError(
            f"checkpoint {model_config.model_path} leaves MTP parameters unloaded: "
            f"{', '.join(missing[:4])}"
        )
    return mtp.eval()

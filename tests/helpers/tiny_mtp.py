"""Tiny random Qwen3-Next / Qwen3.5 checkpoints with one MTP layer (`mtp.*` tensors in the
Hugging Face layout, drawn at random and saved beside the model's own)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

MTP_LAYER_KEY = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}


def save_tiny_with_mtp(family: str, path: Path) -> None:
    """A tiny `family` model at `path` whose checkpoint also holds one random MTP layer: the
    attention and norms shaped as the model's first full-attention layer's, the feed-forward
    block as layer 0's (the MTP layer counts as layer 0 for MoE), plus fc and three norms."""
    model = save_tiny_linear_hybrid(family, path, **{MTP_LAYER_KEY[family]: 1})
    config = model.config
    attention = list(config.layer_types).index("full_attention")
    prefix = f"model.layers.{attention}."
    generator = torch.Generator().manual_seed(1)  # the MTP layer's draws differ from the model's

    def draw(shape: torch.Size, is_norm: bool) -> torch.Tensor:
        scale = 0.1 if is_norm else 0.2
        return torch.randn(shape, generator=generator) * scale

    hidden = config.hidden_size
    mtp = {
        f"mtp.layers.0.{name[len(source) :]}": draw(tensor.shape, "norm" in name)
        for name, tensor in model.state_dict().items()
        for source in (prefix, "model.layers.0.")
        if name.startswith(source) and (".mlp." in name) == (source != prefix)
    }
    mtp["mtp.fc.weight"] = draw(torch.Size([hidden, 2 * hidden]), False)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = draw(torch.Size([hidden]), True)
    file = path / "model.safetensors"
    save_file({**load_file(file), **mtp}, file, metadata={"format": "pt"})

"""Tiny random Qwen3-Next / Qwen3.5 checkpoints with one MTP layer (`mtp.*` tensors in the
Hugging Face layout, drawn at random and saved beside the model's own), and the drafts that
layer proposes computed in plain torch from transformers' modules (`ReferenceMtp`)."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

MTP_LAYER_KEY = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5": "mtp_num_hidden_layers"}


def save_tiny_with_mtp(family: str, path: Path, **overrides: object) -> torch.nn.Module:
    """A tiny `family` model at `path` whose checkpoint also holds one random MTP layer: the
    attention and norms shaped as the model's first full-attention layer's, the feed-forward
    block as layer 0's (the MTP layer counts as layer 0 for MoE), plus fc and three norms.
    Returns the transformers target (which leaves the MTP tensors unused)."""
    model = save_tiny_linear_hybrid(family, path, **{MTP_LAYER_KEY[family]: 1, **overrides})
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
    return model


class ReferenceMtp:
    """The checkpoint's MTP layer as a plain torch forward over whole sequences: transformers'
    decoder layer of the target's family (full attention, layer 0's feed-forward block), an fc
    and three of its RMS norms, loaded from the `mtp.*` tensors at `path`; embedding, rope and
    LM head are the transformers target's. At position i it reads (token i + 1, the target's
    final hidden state at i) and predicts the token at i + 2:

        x = fc([pre_fc_norm_embedding(embed(token i+1)) | pre_fc_norm_hidden(hidden i)])
        out = norm(decoder_layer(x))      (causal attention over positions 0 .. i)
    """

    def __init__(self, target: torch.nn.Module, path: Path) -> None:
        self.target = target.eval()
        weights = {
            name[len("mtp.") :]: tensor
            for name, tensor in load_file(path / "model.safetensors").items()
            if name.startswith("mtp.")
        }
        config = deepcopy(target.config)
        config.layer_types = ["full_attention", *config.layer_types[1:]]
        decoder_class = type(target.model.layers[0])
        norm_class = type(target.model.norm)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer = decoder_class(config, 0).eval()
        self.layer.load_state_dict(_under(weights, "layers.0."), strict=True)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.fc.load_state_dict(_under(weights, "fc."), strict=True)
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            self.norms[name] = norm_class(hidden, eps=eps)
            self.norms[name].load_state_dict(_under(weights, f"{name}."), strict=True)

    @torch.no_grad()
    def drafts(self, tokens: list[int], num: int) -> list[int]:
        """The `num` greedy drafts after `tokens`: the first from the target's hidden state at
        the second-last token and the last token, each further one from the MTP's own output
        and the previous draft."""
        model = self.target.model
        hidden = model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]
        next_tokens = list(tokens[1:])
        drafts: list[int] = []
        for _ in range(num):
            out = self._forward(torch.tensor(next_tokens), hidden)[-1]
            draft = int(self.target.lm_head(out).argmax())
            drafts.append(draft)
            next_tokens.append(draft)
            hidden = torch.cat([hidden, out[None]])
        return drafts

    def _forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T] tokens after the positions of [T, hidden] target states -> [T, hidden]."""
        model = self.target.model
        norms = self.norms
        embedded = norms["pre_fc_norm_embedding"](model.embed_tokens(next_tokens))
        fused = self.fc(torch.cat([embedded, norms["pre_fc_norm_hidden"](hidden)], dim=-1))
        length = len(next_tokens)
        positions = torch.arange(length)[None]
        rope = model.rotary_emb(fused[None], positions)
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
        out = self.layer(fused[None], rope, attention_mask=causal, position_ids=positions)
        return norms["norm"](out[0])  # type: ignore[no-any-return]


def _under(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix) :]: t for name, t in weights.items() if name.startswith(prefix)}

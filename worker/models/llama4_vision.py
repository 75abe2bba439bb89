"""Llama 4 with images: the vision tower and projector ahead of the Llama 4 text model.

The vision tower is transformers' own Llama 4 vision module (unfolded patch embedding, a class
token, learned positions, 2D rotary attention within one tile, pixel shuffle and an MLP
adapter), then transformers' projector (one linear layer into the text width, no scaling of
either side). Both are loaded from the checkpoint's `vision_model.` and `multi_modal_projector.`
tensors and replicated on every tensor-parallel rank.

The processor cuts an image into a grid of tiles plus a global view (the whole image resized to
one tile) and writes each tile as a run of `<|patch|>` tokens, with separators between them:

    <|image_start|> [P P P P] <|tile_x_separator|> [P P P P] <|tile_y_separator|>
                    <|image|> [P P P P] <|image_end|>                (a 1 x 2 grid, 4 per tile)

The vision tower encodes each tile on its own (attention never crosses tiles), so every tile is
one feature here: `data["pixel_values"]` [1, 3, tile, tile] filling one `<|patch|>` run; the
separators stay ordinary text tokens. Image tokens attend causally, as text.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import Llama4VisionModel
from transformers.models.llama4.modeling_llama4 import Llama4MultiModalProjector

from scheduler.multimodal import MultiModalFeature
from worker.attention.attention import ForwardContext
from worker.config import ModelConfig, ParallelConfig, checkpoint_config
from worker.layers.loading import WeightSource, copy_checked, read_full
from worker.models.llama4 import Llama4ForCausalLM
from worker.weights import renamed_prefix

TEXT_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
"""Checkpoint names of the text model -> ours."""
VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")
"""Checkpoint names of the vision tower and projector (ours alike)."""


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """transformers' `Llama4ForConditionalGeneration`: the text model with images."""

    takes_images = True
    bidirectional_images = False

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        super().__init__(model_config, parallel)
        config = checkpoint_config(model_config)
        self.vision_model: nn.Module = Llama4VisionModel._from_config(  # type: ignore[no-untyped-call]
            config.vision_config, attn_implementation="sdpa", dtype=torch.get_default_dtype()
        )
        self.multi_modal_projector = Llama4MultiModalProjector(config)  # type: ignore[no-untyped-call]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the token embeddings (Llama 4 does not scale them)."""
        embeds: torch.Tensor = self.model.embed_tokens(input_ids)  # type: ignore[operator]
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, ctx, inputs_embeds)
        return hidden

    @torch.inference_mode()
    def embed_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """One [feature.length, hidden] tensor per tile: vision tower, then projector."""
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.cat([feature.data["pixel_values"] for feature in features])
        tiles = self.vision_model(pixels.to(device=weight.device, dtype=weight.dtype))
        encoded = tiles.last_hidden_state  # [tiles, patches after the shuffle, vision out]
        projected = self.multi_modal_projector(encoded.flatten(0, 1))
        per_tile = encoded.shape[1]
        counts = [feature.data["pixel_values"].shape[0] * per_tile for feature in features]
        embeddings = list(torch.split(projected, counts))
        for feature, rows in zip(features, embeddings, strict=True):
            if rows.shape[0] != feature.length:
                raise ValueError(
                    f"image tile {feature.identifier[:12]} gives {rows.shape[0]} patch tokens "
                    f"for a placeholder run of {feature.length}"
                )
        return embeddings

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Vision tensors into `vision_model.` / `multi_modal_projector.`, the text model's from
        `language_model.` into `model.` and `lm_head.`."""
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, WeightSource]]:
            for name, source in weights:
                if not name.startswith(VISION_PREFIXES):
                    yield renamed_prefix(name, TEXT_RENAMES), source
                    continue
                if name not in own:
                    raise ValueError(f"checkpoint tensor {name} matches no vision parameter")
                copy_checked(own[name].data, read_full(source))
                loaded.add(name)

        loaded |= super().load_weights(text_weights())
        return loaded

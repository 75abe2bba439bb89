"""Gemma 4 with images: the vision tower and its projection ahead of the Gemma 4 text model.

The vision tower is transformers' own Gemma 4 vision module (patch embedding with learned 2D
positions, 2D rotary attention among an image's patches, average pooling of k x k patches to the
soft tokens, scaled by sqrt(vision hidden size)), followed by transformers' multimodal embedder
(an unscaled RMS norm, then a projection into the text width). Both are loaded from the
checkpoint's `model.vision_tower.` and `model.embed_vision.` tensors and replicated on every
tensor-parallel rank.

How images enter the text model (transformers' `Gemma4Model.forward`):

    prompt    t5 <boi> [img img ... img] <eoi> t6      the processor expands each image to
                                                       <boi> + num_soft_tokens x <image> + <eoi>
    embeds    scaled token embeddings; the image rows are the projected soft tokens, unscaled
    per-layer inputs (E2B/E4B): the token table reads pad at image rows, the projection reads
              the embeds above (image rows included)

With `use_bidirectional_attention: "vision"` (the larger checkpoints) an image's tokens attend
to each other both ways in the sliding layers only; global layers stay causal.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import AutoModel, PretrainedConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

from scheduler.multimodal import MultiModalFeature
from worker.attention.attention import ForwardContext
from worker.config import ModelConfig, ParallelConfig, checkpoint_config
from worker.layers.loading import WeightSource, copy_checked, read_full
from worker.models.gemma4 import Gemma4ForCausalLM, Gemma4Model

TEXT_PREFIX = "model.language_model."
"""Checkpoint names of the text model (ours: `model.`)."""
VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.")
"""Checkpoint names of the vision tower and its projection (ours: without `model.`)."""
SKIPPED_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
"""The audio encoder: not served."""


def soft_token_counts(position_ids: torch.Tensor, pooling_kernel_size: int) -> list[int]:
    """Soft tokens of each image of a batch: its unpadded patches over k^2 (as transformers)."""
    max_patches = position_ids.shape[1]
    output_length = max_patches // pooling_kernel_size**2
    k_squared = int((max_patches // output_length) ** 0.5) ** 2
    real_patches = (position_ids != -1).all(dim=-1).sum(dim=-1)
    return [int(n) for n in real_patches // k_squared]


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """transformers' `Gemma4ForConditionalGeneration` (images; audio is not served)."""

    takes_images = True

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        config = checkpoint_config(model_config)
        self.image_token_id = int(config.image_token_id)
        super().__init__(model_config, parallel)
        text_config = model_config.hf_config
        self.bidirectional_images = self.images_attend_both_ways(text_config)
        """An image's tokens attend to each other both ways (in the sliding layers only:
        `Gemma4Attention.bidirectional_images_in_layer`)."""
        self.pad_token_id = int(text_config.pad_token_id or 0)
        self.vision_tower: nn.Module = AutoModel.from_config(  # type: ignore[no-untyped-call]
            config.vision_config, attn_implementation="sdpa", dtype=torch.get_default_dtype()
        )
        self.embed_vision = Gemma4MultimodalEmbedder(config.vision_config, text_config)  # type: ignore[arg-type]
        self.pooling_kernel_size = int(config.vision_config.pooling_kernel_size)

    @staticmethod
    def images_attend_both_ways(text_config: PretrainedConfig) -> bool:
        """`use_bidirectional_attention: "vision"`: the scheduler then keeps images whole."""
        return bool(text_config.use_bidirectional_attention == "vision")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: token embeddings scaled by sqrt(hidden), as the forward has them."""
        embeds: torch.Tensor = self.model.embed_tokens(input_ids)  # type: ignore[operator]
        return Gemma4Model.scale_embeddings(embeds)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is not None:  # the per-layer token table reads pad at image rows
            input_ids = torch.where(input_ids == self.image_token_id, self.pad_token_id, input_ids)
        hidden: torch.Tensor = self.model(input_ids, positions, ctx, inputs_embeds)
        return hidden

    @torch.inference_mode()
    def embed_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """One [feature.length, hidden] tensor per image: vision tower, then projection."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for idx, feature in enumerate(features):
            by_shape.setdefault(tuple(feature.data["pixel_values"].shape), []).append(idx)
        rows: list[torch.Tensor | None] = [None] * len(features)
        for indices in by_shape.values():
            group = [features[idx] for idx in indices]
            for idx, encoded in zip(indices, self._encode(group), strict=True):
                rows[idx] = encoded
        embeddings = [row for row in rows if row is not None]
        for feature, encoded in zip(features, embeddings, strict=True):
            if encoded.shape[0] != feature.length:
                raise ValueError(
                    f"image {feature.identifier[:12]} gives {encoded.shape[0]} soft tokens for "
                    f"a placeholder run of {feature.length}"
                )
        return embeddings

    def _encode(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Encode images padded to one patch count in one batch."""
        weight = self.embed_vision.embedding_projection.weight
        device, dtype = weight.device, weight.dtype
        pixels = torch.cat([feature.data["pixel_values"] for feature in features])
        position_ids = torch.cat([feature.data["image_position_ids"] for feature in features])
        position_ids = position_ids.to(device)
        soft_tokens = self.vision_tower(
            pixel_values=pixels.to(device=device, dtype=dtype), pixel_position_ids=position_ids
        ).last_hidden_state  # [sum of soft tokens, vision hidden], padding stripped
        projected = self.embed_vision(inputs_embeds=soft_tokens).to(weight.dtype)
        counts = soft_token_counts(position_ids, self.pooling_kernel_size)
        return list(torch.split(projected, counts))

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """Vision tensors into `vision_tower.` / `embed_vision.`, the text model's into `model.`."""
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, WeightSource]]:
            for name, source in weights:
                if name.startswith(SKIPPED_PREFIXES):
                    continue
                if not name.startswith(VISION_PREFIXES):
                    yield name.replace(TEXT_PREFIX, "model.", 1), source
                    continue
                local = name.removeprefix("model.")
                if local not in own:
                    raise ValueError(f"checkpoint tensor {name} matches no vision parameter")
                copy_checked(own[local].data, read_full(source))
                loaded.add(local)

        loaded |= super().load_weights(text_weights())
        return loaded

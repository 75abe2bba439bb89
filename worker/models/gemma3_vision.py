"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, the 4B and larger checkpoints).

The text model is ours (`Gemma3ForCausalLM`); the SigLIP vision tower and the projector
(RMS norm, average pooling to `mm_tokens_per_image` tokens, a linear map to the text width) are
transformers' own modules, built from the checkpoint's `vision_config` and loaded by name. They
are replicated: every tensor-parallel rank holds and runs the whole encoder. Image features
replace the placeholder rows unscaled (text embeddings are scaled by sqrt(hidden_size)), and an
image's tokens attend to each other both ways in every layer (`bidirectional_images`).

Checkpoint names: transformers 5 saves `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*` and `lm_head.*`; the released checkpoints use the older
`language_model.model.*`, `vision_tower.*` and `multi_modal_projector.*`. Both load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from transformers import Gemma3Config, SiglipVisionConfig, SiglipVisionModel
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from scheduler.multimodal import MultiModalFeature
from worker.config import ModelConfig, ParallelConfig, checkpoint_config
from worker.layers.loading import WeightSource, default_weight_loader
from worker.models.gemma3 import Gemma3ForCausalLM
from worker.weights import renamed_prefix

logger = logging.getLogger(__name__)

_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
"""Checkpoint name prefixes -> ours (first match wins); transformers' SigLIP tower has no
`vision_model.` level any more."""
_ENCODER_PREFIXES = ("vision_tower.", "multi_modal_projector.")
"""Our encoder parameters: replicated, loaded whole by name (no packed projections)."""


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's text model plus its vision encoder (`worker.multimodal`'s interface)."""

    takes_images = True
    bidirectional_images = True

    def __init__(self, model_config: ModelConfig, parallel: ParallelConfig) -> None:
        super().__init__(model_config, parallel)
        config = checkpoint_config(model_config)
        assert isinstance(config, Gemma3Config), type(config)
        self.vision_tower = SiglipVisionModel(_vision_config(config))
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    @torch.no_grad()
    def embed_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Per image [mm_tokens_per_image, hidden_size]: images of one shape go through the
        tower together."""
        pixels = [_pixel_values(feature) for feature in features]
        outputs: list[torch.Tensor | None] = [None] * len(features)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for idx, image in enumerate(pixels):
            by_shape.setdefault(tuple(image.shape), []).append(idx)
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        device = self.multi_modal_projector.mm_input_projection_weight.device
        for indices in by_shape.values():
            batch = torch.cat([pixels[idx] for idx in indices]).to(device=device, dtype=dtype)
            hidden = self.vision_tower(pixel_values=batch).last_hidden_state
            projected = self.multi_modal_projector(hidden)  # [n, tokens, hidden_size]
            for row, idx in enumerate(indices):
                outputs[idx] = projected[row]
        return [output for output in outputs if output is not None]

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> set[str]:
        """The text model's tensors through its loaders, the encoder's copied whole."""
        encoder = {
            name: param
            for name, param in self.named_parameters()
            if name.startswith(_ENCODER_PREFIXES)
        }
        loaded: set[str] = set()

        def text_weights() -> Iterator[tuple[str, WeightSource]]:
            for name, source in weights:
                renamed = renamed_prefix(name, _RENAMES)
                if not renamed.startswith(_ENCODER_PREFIXES):
                    yield renamed, source
                elif renamed in encoder:
                    default_weight_loader(encoder[renamed], source)
                    loaded.add(renamed)
                else:
                    logger.warning("checkpoint tensor %s matches no parameter; skipped", name)

        return super().load_weights(text_weights()) | loaded


def _vision_config(config: Gemma3Config) -> SiglipVisionConfig:
    """The checkpoint's vision config, with torch's fused attention for the tower."""
    vision_config = config.vision_config
    assert isinstance(vision_config, SiglipVisionConfig), type(vision_config)
    vision_config._attn_implementation = "sdpa"
    return vision_config


def _pixel_values(feature: MultiModalFeature) -> torch.Tensor:
    """[1, channels, height, width] of one image's processed inputs."""
    data = feature.data
    if not isinstance(data, dict) or "pixel_values" not in data:
        raise ValueError(
            f"image {feature.identifier[:12]}: Gemma 3 reads `pixel_values` from its processed "
            "inputs"
        )
    pixels = torch.as_tensor(data["pixel_values"])
    pixels = pixels[None] if pixels.dim() == 3 else pixels
    if pixels.dim() != 4 or pixels.shape[0] != 1:
        raise ValueError(
            f"image {feature.identifier[:12]}: pixel_values of shape {tuple(pixels.shape)}; "
            "one image's [1, channels, height, width] expected"
        )
    return pixels

"""A tiny random Qwen3.5 vision-language checkpoint (dense or MoE text model), saved to a folder.

Text model: the tiny gated-DeltaNet hybrid of the linear-hybrid tests (three DeltaNet layers,
then gated attention), with a head size of 32 of which half rotates, so M-RoPE's interleaved
sections [3, 3, 2] give every axis (temporal, height, width) frequencies of its own. Vision
tower: two blocks of width 32 over 4-pixel patches, merged 2 x 2 into the text width (64).
The vision special tokens take the top of the 256-token vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import transformers

from tests.helpers.tiny_linear_hybrid import COMMON, DELTA_NET, MOE
from tests.helpers.tiny_models import random_eager_model

IMAGE_TOKEN_ID = 250
VIDEO_TOKEN_ID = 251
VISION_START_ID = 252
VISION_END_ID = 253
PATCH_SIZE = 4
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
TEXT: dict[str, object] = {
    **COMMON,
    **DELTA_NET,
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
}
VISION: dict[str, object] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    "num_position_embeddings": 16,
}
SPECIAL_TOKENS = {
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": VIDEO_TOKEN_ID,
    "vision_start_token_id": VISION_START_ID,
    "vision_end_token_id": VISION_END_ID,
}


def build_tiny_qwen35_vlm(moe: bool = False, seed: int = 0) -> torch.nn.Module:
    """A random fp32 eager `Qwen3_5ForConditionalGeneration` (`...Moe...` when `moe`)."""
    if moe:
        config: transformers.PretrainedConfig = transformers.Qwen3_5MoeConfig(
            text_config={**TEXT, **MOE}, vision_config=VISION, **SPECIAL_TOKENS
        )
        name = "Qwen3_5MoeForConditionalGeneration"
    else:
        config = transformers.Qwen3_5Config(
            text_config=TEXT, vision_config=VISION, **SPECIAL_TOKENS
        )
        name = "Qwen3_5ForConditionalGeneration"
    return random_eager_model(config, name, _is_offset, seed)


def save_tiny_qwen35_vlm(path: Path, moe: bool = False, seed: int = 0) -> torch.nn.Module:
    """Build the tiny model, save it to `path`, return the transformers model."""
    model = build_tiny_qwen35_vlm(moe, seed)
    model.save_pretrained(path)
    return model


def _is_offset(name: str) -> bool:
    return "norm" in name or name.endswith(("dt_bias", "A_log", "bias"))


class ImageInputs(NamedTuple):
    """What the image processor gives for one image: patches and their grid."""

    pixel_values: torch.Tensor
    """[grid_t * grid_h * grid_w, 3 * temporal_patch * patch * patch]"""
    image_grid_thw: torch.Tensor
    """[1, 3]: patches along time, height and width."""

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens the image fills (patches merged MERGE_SIZE x MERGE_SIZE)."""
        return int(self.image_grid_thw.prod()) // MERGE_SIZE**2


def random_image_inputs(grid_h: int, grid_w: int, seed: int) -> ImageInputs:
    """Processed inputs of one random image of `grid_h` x `grid_w` patches."""
    generator = torch.Generator().manual_seed(seed)
    width = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE
    pixels = torch.randn(grid_h * grid_w, width, generator=generator)
    return ImageInputs(pixels, torch.tensor([[1, grid_h, grid_w]]))


def image_prompt(segments: list[list[int] | ImageInputs]) -> list[int]:
    """Prompt token ids of text runs and images (each image: start, its placeholders, end)."""
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, ImageInputs):
            ids += [VISION_START_ID, *[IMAGE_TOKEN_ID] * segment.num_tokens, VISION_END_ID]
        else:
            ids += segment
    return ids


def hf_greedy_with_images(
    hf_model: torch.nn.Module, prompt: list[int], images: list[ImageInputs], num_new: int
) -> list[int]:
    """transformers' greedy continuation of a prompt holding `images` (in prompt order)."""
    input_ids = torch.tensor([prompt])
    kwargs: dict[str, torch.Tensor] = {}
    if images:
        kwargs["pixel_values"] = torch.cat([image.pixel_values for image in images])
        kwargs["image_grid_thw"] = torch.cat([image.image_grid_thw for image in images])
        kwargs["mm_token_type_ids"] = (input_ids == IMAGE_TOKEN_ID).int()
    with torch.no_grad():
        out = hf_model.generate(input_ids, max_new_tokens=num_new, do_sample=False, **kwargs)
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens

"""A tiny random Qwen3.5 vision-language checkpoint (dense or MoE text model) with its processor,
saved to a folder, built offline.

Text model: the tiny gated-DeltaNet hybrid of the linear-hybrid tests (three DeltaNet layers,
then gated attention), with a head size of 32 of which half rotates, so M-RoPE's interleaved
sections [3, 3, 2] give every axis (temporal, height, width) frequencies of its own. Vision
tower: two blocks of width 32 over 4-pixel patches, merged 2 x 2 into the text width (64).
Processor: Qwen2-VL's image processor at 4-pixel patches within 64..1024 pixels (so an image
fills 1 to 16 placeholder tokens), and a byte-level tokenizer of Qwen3.5's kind without merges
(one token per byte, ids 0..255) with Qwen's vision tokens after the bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

from cluster.engine.mm_qwen3_5 import Qwen3_5ImageProcessor, load_qwen3_5_processor
from tests.helpers.tiny_linear_hybrid import COMMON, DELTA_NET, MOE
from tests.helpers.tiny_models import random_eager_model

END_OF_TEXT = "<|endoftext|>"
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = range(257, 261)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
"""What stands for one image in prompt text."""
MIN_PIXELS, MAX_PIXELS = 64, 1024
PATCH_SIZE = 4
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
TEXT: dict[str, object] = {
    **COMMON,
    **DELTA_NET,
    "vocab_size": 264,
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 100.0,
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
    """Build the tiny model, save it and its processor to `path`, return the transformers model."""
    model = build_tiny_qwen35_vlm(moe, seed)
    model.save_pretrained(path)
    save_tiny_qwen35_processor(path)
    return model


def add_mtp_layer(path: Path, hf_model: torch.nn.Module) -> None:
    """Add one random MTP layer (`mtp.*`, as released Qwen3.5 checkpoints hold) to the checkpoint
    at `path`: attention shaped as the first full-attention layer's, the MLP as layer 0's."""
    config = hf_model.config.text_config
    attention = list(config.layer_types).index("full_attention")
    prefix, first = f"model.language_model.layers.{attention}.", "model.language_model.layers.0."
    generator = torch.Generator().manual_seed(1)

    def draw(shape: torch.Size, is_norm: bool) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * (0.1 if is_norm else 0.2)

    state = hf_model.state_dict()
    mtp = {
        f"mtp.layers.0.{name[len(source) :]}": draw(tensor.shape, "norm" in name)
        for name, tensor in state.items()
        for source in (prefix, first)
        if name.startswith(source) and (".mlp." in name) == (source == first)
    }
    hidden = config.hidden_size
    mtp["mtp.fc.weight"] = draw(torch.Size([hidden, 2 * hidden]), False)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = draw(torch.Size([hidden]), True)
    file = path / "model.safetensors"
    save_file({**load_file(file), **mtp}, file, metadata={"format": "pt"})
    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    saved["text_config"]["mtp_num_hidden_layers"] = 1
    config_file.write_text(json.dumps(saved))


def save_tiny_qwen35_processor(path: Path) -> Qwen3_5ImageProcessor:
    """Save the tokenizer and image processor to `path` (the model folder); return the
    processor the engine builds from them."""
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[byte]: byte for byte in range(256)}
    tokenizer = Qwen3_5Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token=END_OF_TEXT)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    assert tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)) == list(range(257, 261))
    tokenizer.save_pretrained(path)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    image_processor.save_pretrained(path)
    return load_qwen3_5_processor(str(path))


def random_image(seed: int, width: int, height: int) -> Image.Image:
    """An RGB image of random pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def hf_greedy_from_text(
    hf_model: torch.nn.Module,
    processor: Qwen3_5ImageProcessor,
    prompt: str,
    images: list[Image.Image],
    num_new: int,
) -> list[int]:
    """transformers' greedy continuation of `prompt` (one IMAGE_PLACEHOLDER per image) with the
    processor's inputs (token ids, patches, grids, token types)."""
    inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="pt")
    inputs.pop("attention_mask", None)
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=num_new, do_sample=False)
    tokens: list[int] = out[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens


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

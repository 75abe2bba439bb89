"""Qwen3.5 with images against transformers (CPU fp32), model level: the vision tower's rows per
image, the M-RoPE positions of prompts holding 0, 1 and 2 images, and the rotary tables at them.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from scheduler.multimodal import MultiModalFeature
from tests.helpers.tiny_models import load_our_model
from tests.helpers.tiny_qwen35_vlm import (
    IMAGE_TOKEN_ID,
    ImageInputs,
    image_prompt,
    random_image_inputs,
    save_tiny_qwen35_vlm,
)

pytestmark = pytest.mark.parity

WIDE = random_image_inputs(4, 6, seed=1)  # 2 x 3 merged: 6 tokens, wider than tall
TALL = random_image_inputs(6, 2, seed=2)  # 3 x 1 merged: 3 tokens, taller than wide


class Saved(NamedTuple):
    hf_model: torch.nn.Module
    ours: torch.nn.Module


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    path: Path = tmp_path_factory.mktemp("qwen35_vlm")
    hf_model = save_tiny_qwen35_vlm(path)
    return Saved(hf_model, load_our_model(path))


def features_of(prompt: list[int], images: list[ImageInputs]) -> list[MultiModalFeature]:
    """One feature per image at its placeholder run, as the input processor hands them over."""
    features, start = [], 0
    for number, image in enumerate(images):
        offset = prompt.index(IMAGE_TOKEN_ID, start)
        data = {"pixel_values": image.pixel_values, "image_grid_thw": image.image_grid_thw}
        features.append(
            MultiModalFeature("image", f"image{number}", offset, image.num_tokens, data)
        )
        start = offset + image.num_tokens
    return features


PROMPTS = {
    "text": ([[3, 4, 5, 6, 7]], []),
    "one image": ([[3, 4], WIDE, [5, 6, 7]], [WIDE]),
    "two images": ([[3], WIDE, [5, 6], TALL, [8]], [WIDE, TALL]),
    "image last": ([[3, 4], TALL], [TALL]),
}


@pytest.mark.parametrize("case", list(PROMPTS))
def test_mrope_positions_match_get_rope_index(saved: Saved, case: str) -> None:
    """Each token's (t, h, w) position and the decode delta equal transformers'."""
    segments, images = PROMPTS[case]
    prompt = image_prompt(segments)
    ours = saved.ours.mrope_positions(len(prompt), features_of(prompt, images))
    input_ids = torch.tensor([prompt])
    grids = torch.cat([image.image_grid_thw for image in images]) if images else None
    expected, delta = saved.hf_model.model.get_rope_index(
        input_ids, (input_ids == IMAGE_TOKEN_ID).int(), grids
    )
    np.testing.assert_array_equal(ours.positions, expected[:, 0].numpy())
    assert ours.delta == int(delta)


def test_mrope_tables_match_transformers_rotary(saved: Saved) -> None:
    """cos/sin at [3, T] positions equal transformers' interleaved M-RoPE; [T] text positions
    give the tables of the same positions on every axis."""
    prompt = image_prompt(PROMPTS["two images"][0])
    positions = saved.ours.mrope_positions(len(prompt), features_of(prompt, [WIDE, TALL]))
    axes = torch.from_numpy(positions.positions)
    reference = Qwen3_5TextRotaryEmbedding(saved.hf_model.config.text_config)
    cos, sin = reference(torch.zeros(1), axes[:, None, :])
    tables = saved.ours.model.rotary_emb(axes)
    torch.testing.assert_close(tables.cos, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(tables.sin, sin[0], rtol=0, atol=0)
    assert not torch.equal(tables.cos, saved.ours.model.rotary_emb(axes[0]).cos)
    text = torch.arange(7)
    plain, repeated = (
        saved.ours.model.rotary_emb(text),
        saved.ours.model.rotary_emb(text.expand(3, -1)),
    )
    assert torch.equal(plain.cos, repeated.cos)
    assert torch.equal(plain.sin, repeated.sin)


def test_vision_tower_rows_match_transformers(saved: Saved) -> None:
    """Two images of different sizes encoded in one call give transformers' merged rows each."""
    prompt = image_prompt(PROMPTS["two images"][0])
    rows = saved.ours.embed_images(features_of(prompt, [WIDE, TALL]))
    with torch.no_grad():
        expected = saved.hf_model.model.get_image_features(
            torch.cat([WIDE.pixel_values, TALL.pixel_values]),
            torch.cat([WIDE.image_grid_thw, TALL.image_grid_thw]),
        ).pooler_output
    assert [r.shape[0] for r in rows] == [WIDE.num_tokens, TALL.num_tokens]
    for ours, theirs in zip(rows, expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_grid_that_does_not_fill_the_placeholder_run_is_refused(saved: Saved) -> None:
    prompt = image_prompt(PROMPTS["one image"][0])
    (feature,) = features_of(prompt, [WIDE])
    short = MultiModalFeature("image", "short", feature.offset, feature.length - 1, feature.data)
    with pytest.raises(ValueError, match="fills 6 positions, its placeholder run 5"):
        saved.ours.embed_images([short])

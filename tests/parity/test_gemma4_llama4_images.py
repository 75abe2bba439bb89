"""Gemma 4 and Llama 4 take images: our checkpoint loading and image encoders against
transformers' `Gemma4ForConditionalGeneration` / `Llama4ForConditionalGeneration` (tiny random
configs, fp32, built offline).

Both families load every tensor of the checkpoint (vision tower and projector included), and
`embed_images` gives, per placeholder run, exactly the rows transformers inserts there
(`get_image_features` + projection) with the same attention implementation (sdpa).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_gemma4_llama4_vlm import (
    gemma4_inputs,
    images,
    llama4_inputs,
    save_tiny_gemma4_vlm,
    save_tiny_llama4_vlm,
)
from tests.helpers.tiny_models import load_our_model

pytestmark = pytest.mark.parity


def test_gemma4_images_embed_as_transformers(tmp_path: Path) -> None:
    hf_model, tokenizer = save_tiny_gemma4_vlm(tmp_path)
    words = ["t5", "<|image|>", "t7", "<|image|>", "t8"]
    token_ids, features, tensors = gemma4_inputs(tokenizer, words, images([(16, 24), (30, 20)]))
    ours = load_our_model(tmp_path)  # asserts every parameter is loaded
    assert type(ours).__name__ == "Gemma4ForConditionalGeneration"
    assert ours.takes_images

    hf_model.model.vision_tower.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = hf_model.model.get_image_features(
            tensors["pixel_values"], tensors["image_position_ids"]
        ).pooler_output
    got = ours.embed_images(features)
    assert [rows.shape[0] for rows in got] == [feature.length for feature in features]
    for rows, reference in zip(got, expected, strict=True):
        assert torch.equal(rows, reference)
    # the rows fill the runs of `<|image|>` soft tokens between the begin / end markers
    image_token = tokenizer.convert_tokens_to_ids("<|image|>")
    assert sum(token == image_token for token in token_ids) == sum(f.length for f in features)


def test_llama4_tiles_embed_as_transformers(tmp_path: Path) -> None:
    hf_model, tokenizer = save_tiny_llama4_vlm(tmp_path)
    words = ["t5", "<|image|>", "t7", "<|image|>", "t8"]
    _, features, pixel_values = llama4_inputs(tokenizer, words, [(1, 2), (1, 1)])
    assert len(features) == 4  # two tiles and the global view, then a one-tile image
    ours = load_our_model(tmp_path)  # asserts every parameter is loaded
    assert type(ours).__name__ == "Llama4ForConditionalGeneration"
    assert ours.takes_images

    hf_model.vision_model.set_attn_implementation("sdpa")
    with torch.no_grad():
        tiles = hf_model.get_image_features(pixel_values=pixel_values).last_hidden_state
        expected = hf_model.multi_modal_projector(tiles.flatten(0, 1))
    got = ours.embed_images(features)
    assert [rows.shape[0] for rows in got] == [feature.length for feature in features]
    assert torch.equal(torch.cat(got), expected)

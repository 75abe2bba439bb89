"""Tiny random Gemma 4 and Llama 4 image-text checkpoints, with their tokenizer and image inputs,
built offline.

The tokenizer is word level (t0..tN) plus each family's special tokens at the top of the
vocabulary. Gemma 4's images go through transformers' `Gemma4ImageProcessorPil` and its
processor's own placeholder expansion (`Gemma4Processor.replace_image_token`); the full
processors need torchvision for their video part, absent on CPU machines; the Gemma 4 folder
holds the image processor config and a chat template, from which the engine builds its
images-only processor (`cluster.engine.mm_gemma4`). Llama 4's image
processor exists only for torchvision, so its tiles are random pixels of the processor's
output shape, laid out in the prompt by `Llama4Processor._prompt_split_image`. The features are
cut from those outputs by the engine's adapter entries (`cluster.engine.mm_adapters`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from cluster.engine.mm_adapters import IMAGE_ADAPTERS
from cluster.engine.mm_inputs import feature_identifier, placeholder_runs
from scheduler.multimodal import MultiModalFeature
from tests.helpers.tiny_gemma4_gpt_oss import GEMMA4
from tests.helpers.tiny_models import BASE, CHUNKED_FAMILIES, random_eager_model

VOCAB_SIZE = 256
GEMMA4_SPECIAL = {
    "image_token": "<|image|>",
    "boi_token": "<|boi|>",
    "eoi_token": "<|eoi|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|boa|>",
    "eoa_token": "<|eoa|>",
}
LLAMA4_SPECIAL = {
    "image_start": "<|image_start|>",
    "image_end": "<|image_end|>",
    "image": "<|image|>",
    "patch": "<|patch|>",
    "tile_x": "<|tile_x_separator|>",
    "tile_y": "<|tile_y_separator|>",
}
GEMMA4_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "patch_size": 4,
    "pooling_kernel_size": 2,
    "position_embedding_size": 32,
}
GEMMA4_IMAGES = {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2}
"""Image processor options: at most 70 soft tokens of 2 x 2 pooled 4-pixel patches."""
GEMMA4_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 't1 ' }}"
    "{% if m['content'] is string %}{{ m['content'] + ' ' }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ '<|image|> ' }}{% else %}{{ p['text'] + ' ' }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 't2' }}{% endif %}"
)
"""Each message is `t1 <content>`, an image part Gemma 4's `<|image|>` placeholder, the
generation prompt `t2` (Gemma 4's template with words of this vocabulary)."""
LLAMA4_TILE = 16
LLAMA4_VISION = {
    "hidden_size": 32,
    "intermediate_size": 128,  # the pixel shuffle's width: hidden / ratio^2
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": LLAMA4_TILE,
    "patch_size": 4,
    "pixel_shuffle_ratio": 0.5,
    "projector_input_dim": 48,
    "projector_output_dim": 48,
    "vision_output_dim": 48,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def save_tokenizer(
    path: Path, special: dict[str, str], pad_token: str | None = None
) -> PreTrainedTokenizerFast:
    """Word tokenizer t0..t{n-1}, then `special`'s tokens as the last ids; saved to `path`."""
    first_special = VOCAB_SIZE - len(special)
    vocab = {f"t{i}": i for i in range(first_special)}
    vocab |= {token: first_special + i for i, token in enumerate(special.values())}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", pad_token=pad_token, extra_special_tokens=special
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def _random_model(config: transformers.PretrainedConfig, model_class: str) -> PreTrainedModel:
    return random_eager_model(config, model_class, lambda name: "norm" in name or "scale" in name)


def save_tiny_gemma4_vlm(
    path: Path, bidirectional: bool = True
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A random `Gemma4ForConditionalGeneration` (the tiny Gemma 4 text model of the text tests,
    pad 0, bidirectional image attention when asked) with its tokenizer, saved to `path` with
    the image processor config (as a released checkpoint's, naming the torchvision
    `Gemma4ImageProcessor`) and a chat template."""
    tokenizer = save_tokenizer(path, GEMMA4_SPECIAL, pad_token="t0")
    transformers.Gemma4ImageProcessorPil(**GEMMA4_IMAGES).save_pretrained(path)
    (path / "chat_template.jinja").write_text(GEMMA4_CHAT_TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA4_SPECIAL.items()}
    text = {**GEMMA4, "pad_token_id": 0}
    text["use_bidirectional_attention"] = "vision" if bidirectional else None
    config = transformers.Gemma4Config(
        text_config=text,
        vision_config=GEMMA4_VISION,
        audio_config=None,
        image_token_id=ids["image_token"],
        boi_token_id=ids["boi_token"],
        eoi_token_id=ids["eoi_token"],
        audio_token_id=ids["audio_token"],
        boa_token_id=ids["boa_token"],
        eoa_token_index=ids["eoa_token"],
        video_token_id=0,
    )
    model = _random_model(config, "Gemma4ForConditionalGeneration")
    model.save_pretrained(path)
    return model, tokenizer


def save_tiny_llama4_vlm(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A random `Llama4ForConditionalGeneration` (the tiny chunked Llama 4 text model) with its
    tokenizer, saved to `path`."""
    tokenizer = save_tokenizer(path, LLAMA4_SPECIAL)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in LLAMA4_SPECIAL.items()}
    text = {**BASE, **CHUNKED_FAMILIES["llama4"][1], "vocab_size": VOCAB_SIZE}
    config = transformers.Llama4Config(
        text_config=text,
        vision_config=LLAMA4_VISION,
        boi_token_index=ids["image_start"],
        eoi_token_index=ids["image_end"],
        image_token_index=ids["patch"],
    )
    model = _random_model(config, "Llama4ForConditionalGeneration")
    model.save_pretrained(path)
    return model, tokenizer


def images(sizes: list[tuple[int, int]], seed: int = 0) -> list[np.ndarray]:
    """Random RGB images [height, width, 3] (uint8) of the given sizes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in sizes]


def adapter_features(
    architecture: str, processor: object, token_ids: list[int], outputs: dict[str, torch.Tensor]
) -> list[MultiModalFeature]:
    """One feature per placeholder run of `token_ids`, cut from the processor's batched
    `outputs` by the architecture's adapter entry, as the engine's input processing does."""
    adapter = IMAGE_ADAPTERS[architecture]
    runs = placeholder_runs(token_ids, adapter.placeholder_token_id(processor))
    pieces = adapter.split(outputs, len(runs)) if runs else []
    return [
        MultiModalFeature("image", feature_identifier(piece), offset, length, piece)
        for (offset, length), piece in zip(runs, pieces, strict=True)
    ]


def gemma4_inputs(
    tokenizer: PreTrainedTokenizerFast, words: list[str], pictures: list[np.ndarray]
) -> tuple[list[int], list[MultiModalFeature], dict[str, torch.Tensor]]:
    """Prompt ids of `words` (each "<|image|>" takes the next picture, expanded by transformers'
    Gemma 4 processor code), one feature per image, and the processor's batched tensors."""
    processor = transformers.Gemma4ImageProcessorPil(**GEMMA4_IMAGES)
    batch = processor(images=pictures, return_tensors="pt") if pictures else {}
    expand = SimpleNamespace(**{name: GEMMA4_SPECIAL[name] for name in GEMMA4_SPECIAL})
    text, image_idx = [], 0
    for word in words:
        if word == GEMMA4_SPECIAL["image_token"]:
            word = transformers.Gemma4Processor.replace_image_token(expand, batch, image_idx)
            image_idx += 1
        text.append(word)
    token_ids = tokenizer(" ".join(text), add_special_tokens=False)["input_ids"]
    tensors = {k: v for k, v in batch.items() if k in ("pixel_values", "image_position_ids")}
    image_id = tokenizer.convert_tokens_to_ids(GEMMA4_SPECIAL["image_token"])
    processor = SimpleNamespace(image_token_id=image_id)  # what the adapter reads of it
    features = adapter_features("Gemma4ForConditionalGeneration", processor, token_ids, tensors)
    return token_ids, features, tensors


def _random_tiles(num_tiles: int, seed: int) -> torch.Tensor:
    """[num_tiles, 3, tile, tile] normalized pixels in [-1, 1]: random 2 x 2 blocks of colour
    (uniform noise per pixel would give every tile nearly the same features)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.rand(num_tiles, 3, 2, 2, generator=generator) * 2 - 1
    return blocks.repeat_interleave(LLAMA4_TILE // 2, 2).repeat_interleave(LLAMA4_TILE // 2, 3)


def llama4_inputs(
    tokenizer: PreTrainedTokenizerFast,
    words: list[str],
    grids: list[tuple[int, int]],
    seeds: list[int] | None = None,
) -> tuple[list[int], list[MultiModalFeature], torch.Tensor]:
    """Prompt ids of `words` (each "<|image|>" takes the next tile grid, laid out by
    transformers' Llama 4 processor code), one feature per tile, and all tiles in prompt order
    (an image of more than one tile ends with its global view), as the processor batches them.
    Image i's pixels are random from `seeds[i]` (default: i)."""
    seeds = list(range(len(grids))) if seeds is None else seeds
    per_tile = (LLAMA4_TILE // LLAMA4_VISION["patch_size"]) ** 2 // 4  # pixel shuffle 0.5
    text, tiles, grid_idx = [], [], 0
    for word in words:
        if word == LLAMA4_SPECIAL["image"]:
            ratio_h, ratio_w = grids[grid_idx]
            word = transformers.Llama4Processor._prompt_split_image(None, grids[grid_idx], per_tile)
            num_tiles = ratio_h * ratio_w + (1 if ratio_h * ratio_w > 1 else 0)
            tiles.append(_random_tiles(num_tiles, seeds[grid_idx]))
            grid_idx += 1
        text.append(word)
    token_ids = tokenizer(" ".join(text), add_special_tokens=False)["input_ids"]
    pixel_values = torch.cat(tiles) if tiles else torch.empty(0, 3, LLAMA4_TILE, LLAMA4_TILE)
    processor = SimpleNamespace(tokenizer=tokenizer, img_patch_token=LLAMA4_SPECIAL["patch"])
    outputs = {"pixel_values": pixel_values}
    features = adapter_features("Llama4ForConditionalGeneration", processor, token_ids, outputs)
    return token_ids, features, pixel_values

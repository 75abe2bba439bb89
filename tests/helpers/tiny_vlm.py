"""A tiny random Gemma 3 vision-language checkpoint with its processor, built in-process and saved
to a folder (no downloads).

Text model: the tiny Gemma 3 of `tiny_models` (sliding window 6, four layers) without the final
softcap, as released Gemma 3 configs have it (transformers' image model applies none). Vision
tower: two SigLIP layers of width 32 over 56-pixel images in 14-pixel patches (16 patches),
pooled 2 x 2 into `MM_TOKENS` = 4 image tokens. The processor is transformers' `Gemma3Processor`:
its image processor resizes to 56 x 56 and its word-level tokenizer knows t0..t252 plus the
image tokens at the top of the 256-token vocabulary, so a prompt's `<start_of_image>` expands to
`<start_of_image>` + 4 `<image_soft_token>` + `<end_of_image>`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import Gemma3ImageProcessor, Gemma3Processor, PreTrainedTokenizerFast

from scheduler.multimodal import MultiModalFeature
from tests.helpers.tiny_models import BASE, FAMILIES, random_eager_model

BOI_ID, EOI_ID, IMAGE_ID = 253, 254, 255
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE = 56
MM_TOKENS = 4
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": 14,
}


def build_tiny_gemma3_vlm(seed: int = 0) -> torch.nn.Module:
    """A random fp32 eager `Gemma3ForConditionalGeneration`."""
    text = {**BASE, **FAMILIES["gemma3"][1], "final_logit_softcapping": None}
    text.pop("tie_word_embeddings")
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=MM_TOKENS,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
        image_token_index=IMAGE_ID,
        tie_word_embeddings=True,
    )
    return random_eager_model(config, "Gemma3ForConditionalGeneration", _is_offset, seed)


def _is_offset(name: str) -> bool:
    return "norm" in name or name.endswith("bias")


def build_tiny_processor() -> Gemma3Processor:
    """transformers' Gemma 3 processor over the tiny vocabulary."""
    vocab = {f"t{i}": i for i in range(BOI_ID)}
    vocab.update({BOI: BOI_ID, EOI: EOI_ID, IMAGE: IMAGE_ID})
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="t0",
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
    )
    image_processor = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(image_processor, tokenizer, image_seq_length=MM_TOKENS)


def save_tiny_gemma3_vlm(path: Path, seed: int = 0) -> torch.nn.Module:
    """Save the tiny model and its processor to `path`; return the transformers model."""
    model = build_tiny_gemma3_vlm(seed)
    model.save_pretrained(path)
    build_tiny_processor().save_pretrained(path)
    return model


def random_image(seed: int, size: tuple[int, int] = (40, 64)) -> Image.Image:
    """A random RGB image (any size: the processor resizes it)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def process(processor: Gemma3Processor, text: str, images: list[Image.Image]) -> dict:
    """The processor's tensors for one prompt (`BOI` in `text` marks each image)."""
    return dict(processor(text=text, images=images or None, return_tensors="pt"))


def features_of(inputs: dict) -> tuple[MultiModalFeature, ...]:
    """One feature per image: its `<image_soft_token>` run, a hash of its pixels, its pixels."""
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i, token in enumerate(ids) if token == IMAGE_ID and ids[i - 1] != IMAGE_ID]
    features = []
    for image_idx, start in enumerate(starts):
        pixels = inputs["pixel_values"][image_idx : image_idx + 1]
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
        features.append(
            MultiModalFeature("image", digest, start, MM_TOKENS, {"pixel_values": pixels})
        )
    return tuple(features)


def hf_greedy_with_images(
    model: torch.nn.Module, inputs: dict, num_new: int
) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of one processed prompt, and each token's logprob."""
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=num_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens: list[int] = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(logits[0].double(), -1)[token])
        for logits, token in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs

"""Gemma 3 sees images: a tiny random `Gemma3ForConditionalGeneration` with transformers' own
processor, served by `LLM`, gives transformers' greedy tokens for prompts holding 0, 1 and 2
images (an image's tokens attending to each other both ways, in sliding and full layers),
through prefix-cache hits and chunked prefill; the same image hits past itself, another image
with the same text does not; each image is encoded once and dropped when no request needs it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster import LLM, SamplingParams
from tests.helpers.engine_probe import encoder_cache
from tests.helpers.tiny_vlm import (
    BOI,
    MM_TOKENS,
    build_tiny_processor,
    features_of,
    hf_greedy_with_images,
    process,
    random_image,
    save_tiny_gemma3_vlm,
)
from worker.config import ModelConfig, ParallelConfig
from worker.model_loader import load_model

NUM_NEW = 8
ENGINE = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 1 << 22}
TEXT = f"t5 t6 t7 {BOI} t8 t9 t10 {BOI} t11 t12 t13"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, Any]:
    path = tmp_path_factory.mktemp("gemma3_vlm")
    hf_model = save_tiny_gemma3_vlm(path)
    return path, hf_model, build_tiny_processor()


@pytest.fixture(scope="module")
def llm(served: tuple[Path, torch.nn.Module, Any]) -> LLM:
    return LLM(str(served[0]), max_model_len=64, **ENGINE)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=0)


def _prompt(text: str, images: list[Any]) -> dict[str, Any] | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _check(served, output: Any, text: str, images: list[Any]) -> None:
    """Greedy tokens as transformers gives them, each with its logprob within 1e-4 (so any
    difference in what a token attends to shows even where the tiny model's argmax holds)."""
    _, hf_model, processor = served
    tokens, logprobs = hf_greedy_with_images(hf_model, process(processor, text, images), NUM_NEW)
    completion = output.outputs[0]
    assert completion.token_ids == tokens, text
    got = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens, strict=True)]
    assert got == pytest.approx(logprobs, abs=1e-4), text


def test_greedy_tokens_match_transformers_with_0_1_2_images(llm: LLM, served) -> None:
    cases = [
        ("t5 t6 t7 t8 t9 t10 t11", []),
        (f"t5 t6 {BOI} t7 t8 t9", [random_image(1)]),
        (TEXT, [random_image(2), random_image(3)]),
    ]
    cache = encoder_cache(llm)
    calls, encoded = cache.num_encoder_calls, cache.num_images_encoded
    outputs = llm.generate([_prompt(text, images) for text, images in cases], _greedy())
    for (text, images), output in zip(cases, outputs, strict=True):
        _check(served, output, text, images)
    # the three images were scheduled in one step: one encoder call, then dropped
    assert (cache.num_encoder_calls - calls, cache.num_images_encoded - encoded) == (1, 3)
    assert len(cache) == 0


def test_prefix_hits_past_the_same_image_and_not_past_another(llm: LLM, served) -> None:
    llm.client.core.scheduler.reset_prefix_cache()
    first, second = [random_image(4), random_image(5)], [random_image(4), random_image(6)]
    offsets = [f.offset for f in features_of(process(served[2], TEXT, second))]
    cold = llm.generate(_prompt(TEXT, first), _greedy())[0]
    warm = llm.generate(_prompt(TEXT, first), _greedy())[0]
    other = llm.generate(_prompt(TEXT, second), _greedy())[0]
    _check(served, cold, TEXT, first)
    _check(served, warm, TEXT, first)
    assert warm.num_cached_tokens > offsets[1] + MM_TOKENS  # past both images
    assert offsets[0] + MM_TOKENS <= other.num_cached_tokens <= offsets[1]  # not past image 2
    _check(served, other, TEXT, second)


def test_chunked_prefill_keeps_images_whole_and_matches(served) -> None:
    chunked = LLM(
        str(served[0]), max_model_len=64, max_num_batched_tokens=8, max_num_seqs=2, **ENGINE
    )
    cases = [(TEXT, [random_image(7), random_image(8)]), (TEXT, [random_image(9), random_image(7)])]
    outputs = chunked.generate([_prompt(text, images) for text, images in cases], _greedy())
    for (text, images), output in zip(cases, outputs, strict=True):
        _check(served, output, text, images)
    cache = encoder_cache(chunked)
    assert cache.num_encoder_calls > 1  # 20-token prompts in chunks of 8: images in several steps
    assert len(cache) == 0


NAMINGS = {
    "saved": (),  # as transformers 5 saves: language_model.model.*, vision_tower.*, ...
    "released": (("vision_tower.", "vision_tower.vision_model."),),  # google/gemma-3-*-it
    "in_memory": (
        ("language_model.model.", "model.language_model."),
        ("vision_tower.", "model.vision_tower."),
        ("multi_modal_projector.", "model.multi_modal_projector."),
    ),
}


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_checkpoint_loads_whole_and_embeds_images_as_transformers(
    served, tmp_path: Path, naming: str
) -> None:
    """Every tensor naming loads every parameter; image features equal transformers' own."""
    path, hf_model, processor = served
    path = _renamed_checkpoint(path, tmp_path, NAMINGS[naming])
    config = ModelConfig.from_pretrained(path, dtype="float32", device_type="cpu")
    model = load_model(config, ParallelConfig(), "cpu")
    inputs = process(processor, TEXT, [random_image(10), random_image(11)])
    got = model.embed_images(list(features_of(inputs)))
    with torch.no_grad():
        want = hf_model.model.get_image_features(inputs["pixel_values"]).pooler_output
    torch.testing.assert_close(torch.stack(got), want, atol=1e-5, rtol=1e-5)


def _renamed_checkpoint(source: Path, target: Path, renames: tuple[tuple[str, str], ...]) -> Path:
    """`source`'s checkpoint with name prefixes replaced (first match), in `target`."""
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        tensors[name] = tensor
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, target / file.name)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target

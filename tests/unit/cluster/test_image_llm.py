"""`LLM.chat` with image parts and `LLM.generate` with `multi_modal_data` on the tiny Gemma 3
vision-language model give transformers' greedy tokens for the same prompt and images."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.llm import LLM
from scheduler.request import SamplingParams
from tests.helpers.tiny_image_processor import add_chat_template, data_url, image_part
from tests.helpers.tiny_vlm import (
    hf_greedy_with_images,
    random_image,
    save_tiny_gemma3_vlm,
)

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, torch.nn.Module]]:
    folder: Path = tmp_path_factory.mktemp("gemma3-vlm")
    model = save_tiny_gemma3_vlm(folder)
    add_chat_template(folder)
    llm = LLM(
        str(folder),
        dtype="float32",
        block_size=4,
        kv_cache_memory_bytes=8 * 1024 * 1024,
        distributed_executor_backend="uni",
    )
    yield llm, model
    llm.shutdown()


def _transformers_tokens(llm: LLM, model: torch.nn.Module, text: str, images: list[Any]) -> Any:
    processor = llm.inputs.multimodal.processor
    inputs = dict(
        processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    )
    tokens, _ = hf_greedy_with_images(model, inputs, NUM_NEW)
    return inputs["input_ids"][0].tolist(), tokens


def test_chat_with_images_gives_transformers_greedy_tokens(vlm: tuple[LLM, Any]) -> None:
    llm, model = vlm
    first, second = random_image(0), random_image(2)
    text = {"type": "text", "text": "t5 t6"}
    both = [
        image_part(data_url(second)),
        {"type": "text", "text": "t7"},
        image_part(data_url(first)),
    ]
    conversations = [
        [{"role": "user", "content": [text, image_part(data_url(first))]}],
        [{"role": "user", "content": [text, {"type": "image_pil", "image_pil": second}]}],
        [{"role": "system", "content": "t9"}, {"role": "user", "content": both}],
    ]
    images = [[first], [second], [second, first]]
    outputs = llm.chat(conversations, GREEDY)
    for output, shown in zip(outputs, images, strict=True):
        prompt_ids, expected = _transformers_tokens(llm, model, output.prompt, shown)
        assert output.prompt_token_ids == prompt_ids
        assert list(output.outputs[0].token_ids) == expected
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids  # images matter


def test_generate_with_multi_modal_data_gives_transformers_greedy_tokens(
    vlm: tuple[LLM, Any],
) -> None:
    llm, model = vlm
    image = random_image(0)
    text = "t40 <start_of_image> t3"
    (output,) = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY)
    _, expected = _transformers_tokens(llm, model, text, [image])
    assert list(output.outputs[0].token_ids) == expected

"""`LLM.chat` with image parts, `LLM.generate` with `multi_modal_data` and OpenAI batch lines
with image parts on the tiny Gemma 3 vision-language model give transformers' greedy tokens for
the same prompt and images; a bad image fails only its own batch row."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cluster.batch.replica import EngineReplica
from cluster.batch.rows import parse_line
from cluster.config.engine_args import validate_engine_kwargs
from cluster.llm import LLM
from scheduler.request import SamplingParams
from tests.helpers.tiny_image_processor import add_chat_template, data_url, image_part, png_bytes
from tests.helpers.tiny_vlm import (
    hf_greedy_with_images,
    random_image,
    save_tiny_gemma3_vlm,
)

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW)


ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "kv_cache_memory_bytes": 8 * 1024 * 1024,
    "distributed_executor_backend": "uni",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """The tiny model's folder (with a chat template) and the transformers model."""
    path: Path = tmp_path_factory.mktemp("gemma3-vlm")
    model = save_tiny_gemma3_vlm(path)
    add_chat_template(path)
    return path, model


@pytest.fixture(scope="module")
def vlm(folder: tuple[Path, torch.nn.Module]) -> Iterator[tuple[LLM, torch.nn.Module]]:
    llm = LLM(str(folder[0]), **ENGINE)
    yield llm, folder[1]
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


def test_batch_lines_with_images(vlm: tuple[LLM, Any], folder: tuple[Path, Any]) -> None:
    llm, model = vlm
    image = random_image(2)
    corrupt = "data:image/png;base64," + base64.b64encode(png_bytes(image)[:100]).decode()
    lines = [
        {"custom_id": name, "url": "/v1/chat/completions", "body": {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "t5"}, image_part(url)]}
        ], "max_tokens": NUM_NEW, "temperature": 0}}
        for name, url in (("good", data_url(image)), ("bad", corrupt))
    ]  # fmt: skip
    records = [parse_line(i, json.dumps(line)).to_record()["item"] for i, line in enumerate(lines)]
    replica = EngineReplica(validate_engine_kwargs({"model": str(folder[0]), **ENGINE}))
    try:
        rows = [
            json.loads(row) for row in replica({"item": np.array(records, dtype=object)})["row"]
        ]
    finally:
        replica.client.shutdown()
    good, bad = rows
    (reference,) = llm.chat(lines[0]["body"]["messages"], GREEDY)
    _, expected = _transformers_tokens(llm, model, reference.prompt, [image])
    assert good["generated_tokens"] == expected
    assert bad["custom_id"] == "bad"
    assert bad["error"].startswith("messages[0].content[1]: image could not be decoded")

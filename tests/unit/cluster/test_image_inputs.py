"""Image parts and `multi_modal_data` become the model processor's own tokens and one
`MultiModalFeature` per image (transformers' Gemma 3 processor over a tiny vocabulary is the
reference); limits, unsupported parts and bad images are refused naming the part; gRPC messages
and batch lines carry image parts into the same prompt as HTTP."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from google.protobuf import json_format

from cluster.batch.rows import openai_request, parse_line
from cluster.engine.input_processor import InputProcessor, Prompt
from cluster.engine.mm_adapters import split_patches_by_grid
from cluster.engine.mm_inputs import MultiModalConfig, load_multimodal_inputs
from cluster.openai_api.protocol import ChatCompletionRequest
from cluster.serve.grpc import llm_pb2
from cluster.serve.grpc.methods import _request_dict
from tests.helpers.tiny_image_processor import (
    data_url,
    image_part,
    random_image,
    save_tiny_gemma3_processor,
)

FIRST, SECOND = random_image(1), random_image(2, width=20, height=50)
CORRUPT = "data:image/png;base64," + base64.b64encode(b"\x89PNG broken").decode()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-processor")
    save_tiny_gemma3_processor(path)
    return path


def _inputs(folder: Path, **config: Any) -> InputProcessor:
    multimodal = load_multimodal_inputs(str(folder), MultiModalConfig(**config))
    processor = multimodal.processor
    tokenizer = processor.tokenizer if processor is not None else None
    return InputProcessor(tokenizer, 64, 4096, str(folder), multimodal)


@pytest.fixture(scope="module")
def inputs(folder: Path) -> InputProcessor:
    return _inputs(folder)


def _chat(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "t9"}, {"role": "user", "content": list(parts)}]


TWO_IMAGES = _chat(
    {"type": "text", "text": "t3 t4"},
    image_part(data_url(FIRST)),
    {"type": "text", "text": "t5"},
    {"type": "image_pil", "image_pil": SECOND},
)


def _template_view(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as transformers' processors take them (an image part as {"type": "image"})."""
    return [
        {**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in messages
    ]


def test_chat_images_become_the_processors_tokens_and_one_feature_per_image(
    inputs: InputProcessor,
) -> None:
    prompt = inputs.chat(TWO_IMAGES)
    processor = inputs.multimodal.processor
    rendered = processor.apply_chat_template(
        _template_view(TWO_IMAGES), tokenize=False, add_generation_prompt=True
    )
    assert prompt.text == rendered
    expected = processor(
        text=[rendered], images=[[FIRST, SECOND]], return_tensors="pt", add_special_tokens=False
    )
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    image_positions = expected["token_type_ids"][0].nonzero().flatten().tolist()
    filled = [p for f in prompt.mm_features for p in range(f.offset, f.end)]
    assert filled == image_positions
    assert len(prompt.mm_features) == 2
    for index, feature in enumerate(prompt.mm_features):
        assert feature.modality == "image"
        assert torch.equal(
            feature.data["pixel_values"], expected["pixel_values"][index : index + 1]
        )


def test_identifiers_follow_the_image_and_its_processing(
    folder: Path, inputs: InputProcessor
) -> None:
    def identifiers(processor: InputProcessor, *images: Any) -> list[str]:
        parts = [image_part(data_url(image)) for image in images]
        return [f.identifier for f in processor.chat(_chat(*parts)).mm_features]

    first, second, again = identifiers(inputs, FIRST, SECOND, FIRST)
    assert first == again
    assert first != second
    unnormalized = _inputs(folder, processor_kwargs={"do_normalize": False})
    assert identifiers(unnormalized, FIRST) != [first]


def test_generate_with_multi_modal_data(inputs: InputProcessor) -> None:
    text = "t3 <start_of_image> t4 <start_of_image>"
    prompt = inputs.prompt({"prompt": text, "multi_modal_data": {"image": [FIRST, SECOND]}})
    expected = inputs.multimodal.processor(
        text=[text], images=[[FIRST, SECOND]], return_tensors="pt"
    )
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    assert len(prompt.mm_features) == 2
    single = inputs.prompt({"prompt": "t3 <start_of_image>", "multi_modal_data": {"image": FIRST}})
    assert single.mm_features[0].identifier == prompt.mm_features[0].identifier
    with pytest.raises(ValueError, match=r"prompt 0: the prompt has 1 image placeholders .* for 2"):
        inputs.prompt({"prompt": "t3 <start_of_image>", "multi_modal_data": {"image": [FIRST] * 2}})
    with pytest.raises(TypeError, match=r"multi_modal_data\['image'\]\[0\]: must be a PIL image"):
        inputs.prompt({"prompt": "<start_of_image>", "multi_modal_data": {"image": "x.png"}})
    with pytest.raises(ValueError, match="needs the prompt as text"):
        inputs.prompt({"prompt_token_ids": [3], "multi_modal_data": {"image": FIRST}})


def test_too_many_images_and_images_off(folder: Path) -> None:
    three = _chat(*[image_part(data_url(FIRST))] * 3)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content\[2\]: more than 2 images"):
        _inputs(folder, max_images_per_prompt=2).chat(three)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content\[0\]: images are off"):
        _inputs(folder, max_images_per_prompt=0).chat(three)


def test_a_model_without_an_image_adapter_takes_no_images(tmp_path: Path) -> None:
    save_tiny_gemma3_processor(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["Gemma3ForCausalLM"]}')
    text_only = _inputs(tmp_path)
    unreachable = image_part("http://127.0.0.2:1/never-fetched.png")
    with pytest.raises(
        ValueError, match=r"^messages\[1\]\.content\[1\]: this model takes no images"
    ):
        text_only.chat(_chat({"type": "text", "text": "t3"}, unreachable))


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (image_part(CORRUPT), "image could not be decoded"),
        (image_part("data:image/svg+xml;base64,PHN2Zy8+"), "unsupported image type"),
        (image_part("file:///etc/hostname"), "refused"),
        ({"type": "image_url", "image_url": {}}, "needs"),
        ({"type": "input_audio", "input_audio": {}}, "of type 'input_audio' are not supported"),
    ],
)
def test_bad_parts_are_refused_naming_the_part(
    inputs: InputProcessor, part: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=rf"^messages\[1\]\.content\[1\]: .*{message}"):
        inputs.chat(_chat({"type": "text", "text": "t3"}, part))


def test_openai_grpc_and_batch_requests_carry_the_same_images(inputs: InputProcessor) -> None:
    messages = _chat({"type": "text", "text": "t3"}, image_part(data_url(FIRST)))
    body = {"model": "m", "messages": messages, "max_tokens": 4}
    over_http, _ = inputs.openai(ChatCompletionRequest.model_validate(body))
    assert len(over_http.mm_features) == 1
    grpc_body = {**body, "messages": [{"role": "system", "content": "t9"}, _grpc_user(messages)]}
    message = json_format.ParseDict(grpc_body, llm_pb2.ChatCompletionRequest())
    over_grpc, _ = inputs.openai(
        ChatCompletionRequest.model_validate(_request_dict(message, False))
    )
    line = {"custom_id": "a", "url": "/v1/chat/completions", "body": body}
    item = parse_line(0, json.dumps(line))
    assert item.request is not None
    in_batch, _ = inputs.openai(openai_request(item.request["url"], item.request["body"]))
    for other in (over_grpc, in_batch):
        assert _same_prompt(other, over_http)


def _grpc_user(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "user", "content_parts": messages[1]["content"]}


def _same_prompt(a: Prompt, b: Prompt) -> bool:
    ids = [f.identifier for f in a.mm_features] == [f.identifier for f in b.mm_features]
    return a.token_ids == b.token_ids and ids


def test_qwen_style_patches_split_by_their_grids() -> None:
    grids = torch.tensor([[1, 2, 2], [1, 4, 2]])
    patches = torch.arange(12 * 3, dtype=torch.float32).reshape(12, 3)
    pieces = split_patches_by_grid()({"pixel_values": patches, "image_grid_thw": grids}, 2)
    assert [piece["pixel_values"].shape[0] for piece in pieces] == [4, 8]
    assert torch.equal(torch.cat([piece["pixel_values"] for piece in pieces]), patches)
    assert [piece["image_grid_thw"].tolist() for piece in pieces] == [[[1, 2, 2]], [[1, 4, 2]]]

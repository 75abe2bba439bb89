"""Gemma 4 and Llama 4 take images: our checkpoint loading, image encoders and served tokens
against transformers' `Gemma4ForConditionalGeneration` / `Llama4ForConditionalGeneration` (tiny
random configs, fp32, built offline).

Both families load every tensor of the checkpoint (vision tower and projector included), and
`embed_images` gives, per placeholder run, exactly the rows transformers inserts there
(`get_image_features` + projection) with the same attention implementation (sdpa).

Served through `LLM`'s engine (requests carrying the features the adapter entries cut from the
image processors' outputs), prompts with 0, 1 and 2 images give transformers' greedy tokens:
Gemma 4's image tokens attend to each other both ways in its sliding layers only
(`use_bidirectional_attention: "vision"`), with prefill chunks that would otherwise end inside an
image; Llama 4's tiles are one feature each. Prefix caching hits past the same images and never
past the start of another. Gemma 4 also takes images through `LLM.chat`
and `LLM.generate` without torchvision (its images-only processor from the checkpoint folder);
Llama 4's image processor needs torchvision, so without it its images are refused.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

from cluster import LLM, SamplingParams
from cluster.engine.client import collect
from cluster.engine.mm_inputs import MultiModalConfig, load_multimodal_inputs
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from scheduler.multimodal import MultiModalFeature
from tests.helpers.tiny_gemma4_llama4_vlm import (
    GEMMA4_SPECIAL,
    LLAMA4_SPECIAL,
    gemma4_inputs,
    images,
    llama4_inputs,
    save_tiny_gemma4_vlm,
    save_tiny_llama4_vlm,
    save_tokenizer,
)
from tests.helpers.tiny_image_processor import data_url, image_part
from tests.helpers.tiny_models import load_our_model

pytestmark = pytest.mark.parity

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None

NUM_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
ENGINE = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 1 << 22}
IMG = "<|image|>"
WORDS = {
    0: [f"t{i}" for i in range(5, 17)],
    1: ["t5", "t6", IMG, "t7", "t8", "t9"],
    2: ["t5", IMG, "t7", IMG, "t8", "t9", "t10", "t11", "t12", "t13"],
}
"""Prompt words by number of images; each IMG takes the next image."""
GEMMA4_SIZES = [(16, 24), (30, 20)]
"""Image sizes (height, width) of Gemma 4's images: about 60 soft tokens each."""
GEMMA4_CHUNK = 72
"""Tokens a step: the batch's first step ends inside the one-image prompt's image unless the
scheduler keeps images whole (the step's encoder budget, 72 positions, would take it)."""
LLAMA4_GRIDS = [(1, 2), (2, 1)]
"""Tile grids of Llama 4's images (more than one tile: the tiles, then a global view)."""


class Prompt(NamedTuple):
    """One prompt as the engine takes it and the transformers inputs of the same prompt."""

    token_ids: list[int]
    features: list[MultiModalFeature]
    hf_inputs: dict[str, torch.Tensor]


class Served(NamedTuple):
    llm: LLM
    hf_model: torch.nn.Module
    prompt: Callable[[list[int]], Prompt]
    """Image seeds (one per image, 0 to 2 of them) -> the prompt of `WORDS` with those images."""
    tokenizer: PreTrainedTokenizerFast | None = None
    """Gemma 4's, for reference prompts of any words (`_gemma4_prompt`)."""


_request_ids = itertools.count()


def _generate(
    llm: LLM, prompts: list[Prompt], params: SamplingParams = GREEDY
) -> list[RequestOutput]:
    """Outputs of `prompts`, queued together (one batch) in `llm`'s engine."""
    requests = [
        EngineRequest(
            request_id=f"image-{next(_request_ids)}",
            prompt_token_ids=tuple(prompt.token_ids),
            sampling_params=params,
            mm_features=tuple(prompt.features),
        )
        for prompt in prompts
    ]
    streams = [llm.client.add_request(request) for request in requests]
    return [collect(stream) for stream in streams]


def _hf_greedy(
    hf_model: torch.nn.Module, prompt: Prompt, suppress: list[int] | None = None
) -> list[int]:
    """transformers' greedy tokens, never one of `suppress`."""
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            **prompt.hf_inputs,
            max_new_tokens=NUM_NEW,
            do_sample=False,
            suppress_tokens=suppress,
        )
    tokens: list[int] = out[0, ids.shape[1] :].tolist()
    return tokens


class Llama4Generator(torch.nn.Module):
    """transformers' Llama 4 generating from the embeddings its own forward builds (tiles through
    the vision model and projector, scattered over the `<|patch|>` rows): this transformers
    version's `Llama4ForConditionalGeneration.forward` fails on its output type."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        self.hf_model = hf_model

    def generate(self, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
        hf_model = self.hf_model
        embeds = hf_model.get_input_embeddings()(ids)
        tiles = kwargs.pop("pixel_values", None)
        if tiles is not None:
            image = hf_model.get_image_features(pixel_values=tiles, return_dict=True)
            hidden = image.last_hidden_state
            rows = hf_model.multi_modal_projector(hidden.view(-1, hidden.size(-1)))
            mask = hf_model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=rows)
            embeds = embeds.masked_scatter(mask, rows)
        new = hf_model.language_model.generate(inputs_embeds=embeds, **kwargs)
        return torch.cat([ids, new], dim=1)


def _gemma4_prompt(
    tokenizer: PreTrainedTokenizerFast, words: list[str], pictures: list[np.ndarray]
) -> Prompt:
    """The prompt of `words` (each IMG takes the next picture) as the helper's reference path
    (transformers' PIL image processor and placeholder expansion) builds it."""
    token_ids, features, tensors = gemma4_inputs(tokenizer, words, pictures)
    hf_inputs = dict(tensors)
    if pictures:  # transformers' bidirectional mask groups the image tokens by these
        image_id = tokenizer.convert_tokens_to_ids(GEMMA4_SPECIAL["image_token"])
        hf_inputs["mm_token_type_ids"] = (torch.tensor([token_ids]) == image_id).long()
    return Prompt(token_ids, features, hf_inputs)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("gemma4_vlm")
    hf_model, tokenizer = save_tiny_gemma4_vlm(path)  # bidirectional images
    hf_model.model.vision_tower.set_attn_implementation("sdpa")

    def prompt(seeds: list[int]) -> Prompt:
        sizes = GEMMA4_SIZES[: len(seeds)]
        pictures = [images([size], seed)[0] for size, seed in zip(sizes, seeds, strict=True)]
        return _gemma4_prompt(tokenizer, WORDS[len(seeds)], pictures)

    llm = LLM(str(path), max_model_len=160, max_num_batched_tokens=GEMMA4_CHUNK, **ENGINE)
    yield Served(llm, hf_model, prompt, tokenizer)
    llm.shutdown()


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("llama4_vlm")
    hf_model, tokenizer = save_tiny_llama4_vlm(path)
    hf_model.vision_model.set_attn_implementation("sdpa")

    def prompt(seeds: list[int]) -> Prompt:
        grids = LLAMA4_GRIDS[: len(seeds)]
        token_ids, features, tiles = llama4_inputs(tokenizer, WORDS[len(seeds)], grids, seeds)
        return Prompt(token_ids, features, {"pixel_values": tiles} if seeds else {})

    llm = LLM(str(path), max_model_len=120, **ENGINE)
    yield Served(llm, Llama4Generator(hf_model), prompt)
    llm.shutdown()


@pytest.mark.parametrize("family", ["gemma4", "llama4"])
def test_greedy_tokens_match_transformers_with_0_1_2_images(family: str, request) -> None:
    served: Served = request.getfixturevalue(family)
    prompts = [served.prompt([]), served.prompt([1]), served.prompt([2, 3])]
    outputs = _generate(served.llm, prompts)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == _hf_greedy(served.hf_model, prompt)


@pytest.mark.parametrize("family", ["gemma4", "llama4"])
def test_prefix_hits_past_the_same_images_and_not_past_another(family: str, request) -> None:
    served: Served = request.getfixturevalue(family)
    served.llm.client.core.scheduler.reset_prefix_cache()
    same, other = served.prompt([4, 5]), served.prompt([4, 6])  # the second image differs
    assert same.token_ids == other.token_ids
    second_image = _image_starts(other)[1]
    cold, warm, changed = (_generate(served.llm, [prompt])[0] for prompt in (same, same, other))
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids
    assert warm.outputs[0].token_ids == _hf_greedy(served.hf_model, same)
    assert warm.num_cached_tokens >= same.features[-1].end  # past both images
    assert same.features[0].end <= changed.num_cached_tokens <= second_image
    assert changed.outputs[0].token_ids == _hf_greedy(served.hf_model, other)
    assert changed.outputs[0].token_ids != cold.outputs[0].token_ids  # the image is seen


def test_gemma4_images_attend_both_ways_in_sliding_layers_only(gemma4: Served) -> None:
    """Prompt logprobs equal transformers' (whose global layers keep image tokens causal): the
    tiny model's greedy tokens alone do not tell the global layers' masks apart."""
    prompt = gemma4.prompt([7, 8])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (output,) = _generate(gemma4.llm, [prompt], params)
    ids = torch.tensor([prompt.token_ids])
    with torch.no_grad():
        logits = gemma4.hf_model(ids, **prompt.hf_inputs).logits[0, :-1]
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    got = torch.tensor(
        [
            position[token].logprob
            for position, token in zip(
                output.prompt_logprobs[1:], prompt.token_ids[1:], strict=True
            )
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_gemma4_chat_and_generate_take_images(gemma4: Served) -> None:
    """`LLM.chat` with a base64 image part and `LLM.generate` with `multi_modal_data` (through the
    images-only processor built from the folder, with or without torchvision) give the
    reference prompt's token ids and transformers' greedy tokens. Answers are words: a special
    token fed back (`<|audio|>`, `<|image|>`) is embedded as pad by transformers."""
    assert gemma4.tokenizer is not None
    special = sorted(gemma4.tokenizer.convert_tokens_to_ids(list(GEMMA4_SPECIAL.values())))
    words = SamplingParams(
        temperature=0, max_tokens=NUM_NEW, allowed_token_ids=list(range(special[0]))
    )
    pictures = images(GEMMA4_SIZES, seed=9)
    first, second = (Image.fromarray(picture) for picture in pictures)
    conversation = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "t5 t6"},
                image_part(data_url(first)),
                {"type": "text", "text": "t7"},
            ],
        }
    ]
    (chat,) = gemma4.llm.chat([conversation], words)
    text = f"t5 {IMG} t7 {IMG} t8"
    (generated,) = gemma4.llm.generate(
        {"prompt": text, "multi_modal_data": {"image": [first, second]}}, words
    )
    cases = [(chat, pictures[:1]), (generated, pictures)]
    for output, shown in cases:
        assert output.prompt is not None
        want = _gemma4_prompt(gemma4.tokenizer, output.prompt.split(), shown)
        assert output.prompt_token_ids == want.token_ids
        assert output.outputs[0].token_ids == _hf_greedy(gemma4.hf_model, want, special)


TORCHVISION_PROCESSORS = {
    "llama4": ("Llama4ForConditionalGeneration", "Llama4ImageProcessorFast", LLAMA4_SPECIAL),
}


@pytest.mark.skipif(HAS_TORCHVISION, reason="torchvision builds these processors")
@pytest.mark.parametrize("family", list(TORCHVISION_PROCESSORS))
def test_without_torchvision_images_are_refused_saying_why(family: str, tmp_path: Path) -> None:
    """A released checkpoint's processor config names a processor needing torchvision: the
    engine starts and refuses images, naming the missing package."""
    architecture, image_processor, special = TORCHVISION_PROCESSORS[family]
    save_tokenizer(tmp_path, special)
    config = {"architectures": [architecture], "model_type": family}
    (tmp_path / "config.json").write_text(json.dumps(config))
    processor_config = {"image_processor_type": image_processor}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(processor_config))
    inputs = load_multimodal_inputs(str(tmp_path), MultiModalConfig())
    with pytest.raises(ValueError, match=r"^messages\[0\]: .*not installed \(torchvision\)"):
        inputs.check_images(["messages[0]"])


def _image_starts(prompt: Prompt) -> list[int]:
    """First position of each image (a Llama 4 image is several tile features, each with its
    own pixels; its first feature is the first after a run of text)."""
    starts, end = [], -1
    for feature in prompt.features:
        if feature.offset - end > 2:  # tiles of one image are one or two separators apart
            starts.append(feature.offset)
        end = feature.end
    return starts


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

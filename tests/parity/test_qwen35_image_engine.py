"""Qwen3.5 takes images through `LLM`: a tiny random `Qwen3_5ForConditionalGeneration` (and its
MoE sibling) with its images-only processor gives transformers' greedy tokens for prompts holding
0, 1 and 2 images of different sizes (M-RoPE positions, decode at index + delta), with prefill
chunks of 16 tokens that cut through images (each image encoded once, its rows reused by the
next chunk), prefix hits past the same image (and not past another), and a chat whose next turn,
with one more image, resumes from the DeltaNet state checkpoints of the previous one.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from PIL import Image

from cluster import LLM, SamplingParams
from cluster.engine.mm_qwen3_5 import Qwen3_5ImageProcessor, load_qwen3_5_processor
from tests.helpers.engine_probe import encoder_cache, engine_stats
from tests.helpers.tiny_qwen35_vlm import (
    IMAGE_PLACEHOLDER as IMG,
)
from tests.helpers.tiny_qwen35_vlm import (
    IMAGE_TOKEN_ID,
    add_mtp_layer,
    hf_greedy_from_text,
    random_image,
    save_tiny_qwen35_vlm,
)

pytestmark = pytest.mark.parity

NUM_NEW = 8
CHUNK = 16
ENGINE = {
    "dtype": "float32",
    "max_model_len": 128,
    "kv_cache_memory_bytes": 1 << 22,
    "max_num_batched_tokens": CHUNK,
}
WIDE = random_image(1, width=30, height=20)  # 16 x 32 pixels: 8 tokens
TALL = random_image(2, width=12, height=40)  # 40 x 16 pixels: 10 tokens
OTHER = random_image(3, width=30, height=20)  # WIDE's size, other pixels
LETTERS = list(range(ord("a"), ord("z") + 1))
"""Answers of the chat test: letters, so they come back as the same tokens in the next turn."""


class Served(NamedTuple):
    path: Path
    hf_model: torch.nn.Module
    processor: Qwen3_5ImageProcessor


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    path = tmp_path_factory.mktemp("qwen35_vlm")
    hf_model = save_tiny_qwen35_vlm(path)
    return Served(path, hf_model, load_qwen3_5_processor(str(path)))


@pytest.fixture(scope="module")
def llm(served: Served) -> Any:
    engine = LLM(str(served.path), **ENGINE)
    yield engine
    engine.shutdown()


def _prompt(text: str, images: list[Image.Image]) -> dict[str, Any] | str:
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def _image_runs(served: Served, text: str, images: list[Image.Image]) -> list[tuple[int, int]]:
    """(offset, end) of each image's placeholder run in the processed prompt."""
    ids = served.processor(text=[text], images=[images], return_tensors="pt")["input_ids"][0]
    positions = (ids == IMAGE_TOKEN_ID).nonzero().flatten().tolist()
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs


def test_greedy_tokens_match_transformers_with_0_1_2_images(llm: Any, served: Served) -> None:
    cases = [
        ("plain text, no image", []),
        (f"see {IMG} now", [WIDE]),
        (f"a {IMG} b {IMG} c", [WIDE, TALL]),
    ]
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW)
    outputs = llm.generate([_prompt(text, images) for text, images in cases], greedy)
    for (text, images), output in zip(cases, outputs, strict=True):
        want = hf_greedy_from_text(served.hf_model, served.processor, text, images, NUM_NEW)
        assert output.outputs[0].token_ids == want, text
    assert len(encoder_cache(llm)) == 0  # every image dropped once its request is done


def test_chunks_cut_through_an_image_and_reuse_its_encoder_rows(llm: Any, served: Served) -> None:
    text = f"hello world! {IMG} done"
    ((offset, end),) = _image_runs(served, text, [TALL])
    assert offset < CHUNK < end  # the first chunk ends inside the image
    cache = encoder_cache(llm)
    encoded = cache.num_images_encoded
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW)
    (output,) = llm.generate([_prompt(text, [TALL])], greedy)
    want = hf_greedy_from_text(served.hf_model, served.processor, text, [TALL], NUM_NEW)
    assert output.outputs[0].token_ids == want
    assert cache.num_images_encoded - encoded == 1  # encoded once for both chunks


def test_prefix_hits_past_the_same_image_and_not_past_another(llm: Any, served: Served) -> None:
    llm.client.core.scheduler.reset_prefix_cache()
    text = f"first {IMG} second {IMG} the end of it"
    same, other = [WIDE, TALL], [WIDE, OTHER]
    runs = _image_runs(served, text, other)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW)
    cold = llm.generate(_prompt(text, same), greedy)[0]
    warm = llm.generate(_prompt(text, same), greedy)[0]
    changed = llm.generate(_prompt(text, other), greedy)[0]
    want = hf_greedy_from_text(served.hf_model, served.processor, text, same, NUM_NEW)
    assert cold.outputs[0].token_ids == warm.outputs[0].token_ids == want
    assert warm.num_cached_tokens > runs[1][1]  # past both images
    assert changed.num_cached_tokens <= runs[1][0]  # not past the changed image
    assert changed.outputs[0].token_ids == hf_greedy_from_text(
        served.hf_model, served.processor, text, other, NUM_NEW
    )


def test_next_turn_with_one_more_image_resumes_from_the_last(llm: Any, served: Served) -> None:
    """Each turn is the last turn's prompt, its answer and new text with one more image: its
    greedy tokens are transformers', it hits every 16-token block the last turn computed, and
    only its new image is encoded."""
    llm.client.core.scheduler.reset_prefix_cache()
    letters_only = SamplingParams(temperature=0, max_tokens=NUM_NEW, allowed_token_ids=LETTERS)
    suppressed = [token for token in range(264) if token not in LETTERS]
    cache = encoder_cache(llm)
    text, images, computed = f"look {IMG} ", [WIDE], 0
    for new_text, new_image in [("", None), (f" and {IMG} ", TALL), (f" then {IMG} ", OTHER)]:
        text += new_text
        images = [*images, new_image] if new_image is not None else images
        encoded = cache.num_images_encoded
        (output,) = llm.generate([_prompt(text, images)], letters_only)
        inputs = served.processor(text=[text], images=[images], return_tensors="pt")
        inputs.pop("attention_mask")
        with torch.no_grad():
            out = served.hf_model.generate(
                **inputs, max_new_tokens=NUM_NEW, do_sample=False, suppress_tokens=suppressed
            )
        answer = list(output.outputs[0].token_ids)
        assert answer == out[0, inputs["input_ids"].shape[1] :].tolist()
        if computed:
            assert output.num_cached_tokens == computed // CHUNK * CHUNK
            assert cache.num_images_encoded - encoded == 1  # the earlier images hit
        computed = inputs["input_ids"].shape[1] + len(answer) - 1
        text += output.outputs[0].text


def test_moe_checkpoint_takes_images(tmp_path: Path) -> None:
    hf_model = save_tiny_qwen35_vlm(tmp_path, moe=True)
    processor = load_qwen3_5_processor(str(tmp_path))
    engine = LLM(str(tmp_path), **ENGINE)
    text = f"a {IMG} b {IMG} c"
    try:
        (output,) = engine.generate(
            [_prompt(text, [TALL, WIDE])], SamplingParams(temperature=0, max_tokens=NUM_NEW)
        )
    finally:
        engine.shutdown()
    want = hf_greedy_from_text(hf_model, processor, text, [TALL, WIDE], NUM_NEW)
    assert output.outputs[0].token_ids == want


def test_mtp_speculation_keeps_the_image_tokens(served: Served, tmp_path: Path) -> None:
    """A released-style checkpoint with an MTP layer speculates on prompts holding images (the
    drafts see plain positions; verification keeps the target's tokens)."""
    shutil.copytree(served.path, tmp_path, dirs_exist_ok=True)
    add_mtp_layer(tmp_path, served.hf_model)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    engine = LLM(str(tmp_path), speculative_config=spec, **ENGINE)
    text = f"a {IMG} b {IMG} c"
    try:
        (output,) = engine.generate(
            [_prompt(text, [WIDE, TALL])], SamplingParams(temperature=0, max_tokens=NUM_NEW)
        )
        drafted = engine_stats(engine).spec_decoding
    finally:
        engine.shutdown()
    want = hf_greedy_from_text(served.hf_model, served.processor, text, [WIDE, TALL], NUM_NEW)
    assert output.outputs[0].token_ids == want
    assert drafted is not None
    assert drafted.num_draft_tokens > 0


@pytest.mark.slow
def test_two_tensor_parallel_ranks_each_encode_the_images(served: Served) -> None:
    """The vision tower is replicated: two ranks (text model split) give the same tokens."""
    engine = LLM(str(served.path), tensor_parallel_size=2, **ENGINE)
    text = f"a {IMG} b {IMG} c"
    try:
        (output,) = engine.generate(
            [_prompt(text, [WIDE, TALL])], SamplingParams(temperature=0, max_tokens=NUM_NEW)
        )
    finally:
        engine.shutdown()
    want = hf_greedy_from_text(served.hf_model, served.processor, text, [WIDE, TALL], NUM_NEW)
    assert output.outputs[0].token_ids == want

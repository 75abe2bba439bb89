"""Images over two tensor-parallel ranks: the tiny Gemma 3 image model with transformers' own
processor, served by `LLM` on two ranks (a process each, the text model split between them, the
vision tower and projector replicated, each rank encoding the step's images itself), gives
transformers' greedy tokens, each with its logprob within 1e-4, for a prompt with one image
whose tokens attend to each other both ways.
"""

from __future__ import annotations

import pytest

from cluster import LLM, SamplingParams
from tests.helpers.tiny_vlm import (
    BOI,
    build_tiny_processor,
    hf_greedy_with_images,
    process,
    random_image,
    save_tiny_gemma3_vlm,
)

pytestmark = pytest.mark.parity

NUM_NEW = 8


@pytest.mark.timeout(300)
def test_two_ranks_give_transformers_tokens_for_a_prompt_with_an_image(tmp_path) -> None:
    hf_model = save_tiny_gemma3_vlm(tmp_path)
    text, image = f"t5 t6 {BOI} t7 t8 t9", random_image(1)
    llm = LLM(
        str(tmp_path),
        tensor_parallel_size=2,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        kv_cache_memory_bytes=1 << 22,
    )
    try:
        (output,) = llm.generate(
            [{"prompt": text, "multi_modal_data": {"image": [image]}}],
            SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=0),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    inputs = process(build_tiny_processor(), text, [image])
    tokens, logprobs = hf_greedy_with_images(hf_model, inputs, NUM_NEW)
    completion = output.outputs[0]
    assert completion.token_ids == tokens
    got = [entry[token].logprob for entry, token in zip(completion.logprobs, tokens, strict=True)]
    assert got == pytest.approx(logprobs, abs=1e-4)

"""The embedded default model: converted once from the packaged GGUF file, then reused.

Converting dequantises 135M parameters (20-25 s on two cores) and the comparison loads the GGUF
file into transformers too (about 17 s), so those tests are `slow`; both come from session
fixtures (tests/conftest.py), so a session converts once, into a temporary cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.paged_driver import PagedDriver
from worker.config import ModelConfig, ParallelConfig
from worker.default_model import default_gguf_path, ensure_default_model
from worker.model_loader import load_model

PROMPT = "The capital of France is"
NUM_NEW_TOKENS = 12


def test_packaged_gguf_file_is_found() -> None:
    path = default_gguf_path()
    assert path.stat().st_size > 90_000_000
    assert path.read_bytes()[:4] == b"GGUF"


def test_existing_cache_folder_is_returned_without_converting(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert ensure_default_model(tmp_path) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.slow
def test_conversion_is_reused_and_leaves_no_scratch(default_model_dir: Path) -> None:
    start = time.perf_counter()
    assert ensure_default_model(default_model_dir) == default_model_dir
    assert time.perf_counter() - start < 0.5
    assert sorted(p.name for p in default_model_dir.parent.iterdir()) == [default_model_dir.name]


@pytest.mark.slow
def test_converted_folder_loads_in_transformers(default_model_dir: Path, gguf_reference) -> None:
    gguf_tokenizer, _ = gguf_reference
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer(PROMPT).input_ids == gguf_tokenizer(PROMPT).input_ids
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


@pytest.mark.slow
def test_our_llama_generates_like_transformers_on_the_gguf(
    default_model_dir: Path, gguf_reference
) -> None:
    tokenizer, hf_model = gguf_reference
    config = ModelConfig.from_pretrained(default_model_dir, dtype="float32")
    assert config.eos_token_ids == (2,)
    model = load_model(config, ParallelConfig(), "cpu")
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a primary colour."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = {"plain": tokenizer(PROMPT).input_ids, "chat": tokenizer(chat).input_ids}
    expected = {}
    for name, ids in prompts.items():
        # NOTE: an explicit mask: without one, generate() masks every pad token (<|im_end|>,
        # which chat prompts contain) as if it were padding.
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
            )
        expected[name] = out[0, len(ids) :].tolist()
    got = PagedDriver(model, block_size=16, num_blocks=16).generate(prompts, NUM_NEW_TOKENS)
    assert got == expected
    assert tokenizer.decode(got["plain"]).startswith(" Paris")

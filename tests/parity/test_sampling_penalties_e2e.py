"""Penalties through the whole engine (scheduler deltas, runner state, sampler) against
transformers' `generate` with the same logits processors (CPU fp32, greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from cluster import LLM, SamplingParams
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.parity

NUM_NEW = 12
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 1 << 22,
}
PROMPTS = [[(7 * i + 3) % 256 for i in range(20)], [(5 * i + 1) % 64 for i in range(9)]]


class OpenAIPenalties(LogitsProcessor):
    """Frequency and presence penalties over the generated tokens (OpenAI's definition)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones_like(generated, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama")
    return path, save_tiny_model("llama", path)


def _hf(model: torch.nn.Module, prompt: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_NEW, do_sample=False, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def test_penalised_batch_matches_transformers(llama) -> None:
    path, model = llama
    llm = LLM(str(path), **LLM_ARGS)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW)
    repetition = SamplingParams(temperature=0, max_tokens=NUM_NEW, repetition_penalty=1.8)
    openai = SamplingParams(
        temperature=0, max_tokens=NUM_NEW, frequency_penalty=1.5, presence_penalty=0.7
    )
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    results = llm.generate(prompts, [greedy, repetition, openai, repetition], use_tqdm=False)
    llm.shutdown()
    tokens = [result.outputs[0].token_ids for result in results]
    assert tokens[0] == _hf(model, PROMPTS[0])
    assert tokens[1] == _hf(model, PROMPTS[0], repetition_penalty=1.8)
    assert tokens[1] != tokens[0]  # the penalty changed something
    processors = LogitsProcessorList([OpenAIPenalties(len(PROMPTS[1]), 1.5, 0.7)])
    assert tokens[2] == _hf(model, PROMPTS[1], logits_processor=processors)
    assert tokens[3] == _hf(model, PROMPTS[1], repetition_penalty=1.8)


def test_penalties_survive_preemption(llama) -> None:
    path, model = llama
    # 14 blocks of 4 tokens cannot hold three 30-token prompts and their outputs at once.
    llm = LLM(str(path), max_model_len=48, **{**LLM_ARGS, "kv_cache_memory_bytes": 14 * 4096})
    prompts = [[(k * i + k) % 256 for i in range(30)] for k in (3, 5, 7)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, repetition_penalty=1.5)
    results = llm.generate(prompts, params, use_tqdm=False)
    assert llm.client.core.scheduler.num_preemptions > 0
    llm.shutdown()
    for prompt, result in zip(prompts, results, strict=True):
        assert result.outputs[0].token_ids == _hf(model, prompt, repetition_penalty=1.5)

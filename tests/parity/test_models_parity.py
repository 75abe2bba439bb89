"""Our model families against transformers on tiny random models (CPU, fp32).

Prefill logits must match within 1e-4 for a prompt longer than the sliding windows, and greedy
decoding through the paged cache (block size 4) must give transformers' tokens.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from tests.helpers.paged_driver import PagedDriver
from tests.helpers.tiny_models import FAMILIES, WINDOW, build_tiny_model, save_tiny_model
from worker.config import ModelConfig, ParallelConfig
from worker.model_loader import load_model

pytestmark = pytest.mark.parity

PROMPT = [(7 * i + 3) % 256 for i in range(20)]
OTHER_PROMPT = [(11 * i + 5) % 256 for i in range(9)]
NUM_NEW_TOKENS = 32


class Pair:
    """A transformers model and ours, sharing one checkpoint; transformers' greedy runs cached."""

    def __init__(self, hf_model: PreTrainedModel, model: torch.nn.Module) -> None:
        self.hf_model, self.model = hf_model, model
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    def hf_greedy(self, prompt: list[int]) -> list[int]:
        if tuple(prompt) not in self._greedy:
            with torch.no_grad():
                out = self.hf_model.generate(
                    torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False
                )
            self._greedy[tuple(prompt)] = out[0, len(prompt) :].tolist()
        return self._greedy[tuple(prompt)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_model(request.param, path)
    config = ModelConfig.from_pretrained(path, dtype="float32")
    return Pair(hf_model, load_model(config, ParallelConfig(), "cpu"))


def test_prefill_logits_match_transformers(pair: Pair) -> None:
    hf_model, model = pair.hf_model, pair.model
    assert len(PROMPT) > 2 * WINDOW
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    got = PagedDriver(model).step({"req": PROMPT})["req"]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_chunked_prefill_matches_one_shot(pair: Pair) -> None:
    hf_model, model = pair.hf_model, pair.model
    with torch.no_grad():
        expected = hf_model(torch.tensor([PROMPT])).logits[0]
    driver = PagedDriver(model, seed=3)
    chunks = [
        driver.step({"req": PROMPT[start : start + 7]})["req"] for start in range(0, len(PROMPT), 7)
    ]
    torch.testing.assert_close(torch.cat(chunks), expected, atol=1e-4, rtol=0)


def test_greedy_decode_matches_transformers(pair: Pair) -> None:
    expected = pair.hf_greedy(PROMPT)
    got = PagedDriver(pair.model, seed=1).generate({"req": PROMPT}, NUM_NEW_TOKENS)["req"]
    assert got == expected


def test_batched_decode_matches_transformers_per_request(pair: Pair) -> None:
    expected = {"a": pair.hf_greedy(PROMPT), "b": pair.hf_greedy(OTHER_PROMPT)}
    got = PagedDriver(pair.model, seed=2).generate({"a": PROMPT, "b": OTHER_PROMPT}, NUM_NEW_TOKENS)
    assert got == expected


FEATURE_SWITCHES = [
    ("mistral", {"sliding_window": 128}),
    ("qwen2", {"use_sliding_window": False}),
    ("gemma2", {"sliding_window": 128}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma3", {"sliding_window": 128}),
    ("gemma3", {"query_pre_attn_scalar": 16}),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
]


@pytest.mark.parametrize(("family", "switch"), FEATURE_SWITCHES)
def test_tiny_configs_exercise_each_feature(family: str, switch: dict[str, object]) -> None:
    """Guards the parity tests: turning a feature off changes transformers' logits."""
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        on = build_tiny_model(family)(prompt).logits[0]
        off = build_tiny_model(family, **switch)(prompt).logits[0]
    assert (on - off).abs().max() > 1e-2

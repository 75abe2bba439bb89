"""Prefix hits inside a hybrid block (`prefix_match_unit`) give the tokens of a cold prefill.

Tiny random Bamba and GraniteMoeHybrid models (CPU fp32), block size 4 made 12 by page-size
unification; with `prefix_match_unit=4` a prompt keeps state checkpoints every 4 tokens, so
prompts sharing 8 or 20 tokens (not multiples of 12) hit exactly there: the attention block
holding the shared tokens past the last full block is copied, and the Mamba state restored from
the checkpoint. Greedy tokens equal transformers' own, seeded samples equal an engine without
prefix caching, and the hits are asserted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import hf_greedy

pytestmark = pytest.mark.parity

FIRST = [(7 * i + 3) % 256 for i in range(30)]
SHARING = [
    [*FIRST[:8], 9, 8, 7, 6, 5],  # 8 shared tokens: less than one 12-token block
    [*FIRST[:20], *((5 * i + 1) % 256 for i in range(17))],  # one block + 8, long suffix
]
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 24,
    "kv_cache_memory_bytes": 1 << 21,
}
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list]:
    results = llm.generate(prompts, params, use_tqdm=False)
    return [r.outputs[0].token_ids for r in results], [r.num_cached_tokens for r in results]


@pytest.fixture(scope="module", params=["bamba", "granitemoehybrid"])
def saved(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_hybrid(request.param, path)


@pytest.mark.parametrize("mode", ["align", "all"])
def test_greedy_hits_inside_a_block_give_transformers_tokens(
    saved: tuple[Path, torch.nn.Module], mode: str
) -> None:
    path, hf_model = saved
    llm = LLM(str(path), prefix_match_unit=4, mamba_cache_mode=mode, **LLM_ARGS)
    try:
        tokens, _ = _run(llm, [FIRST], GREEDY)
        assert tokens == [hf_greedy(hf_model, FIRST, 16)]
        tokens, hits = _run(llm, SHARING, GREEDY)
    finally:
        llm.shutdown()
    assert hits == [8, 20]
    assert tokens == [hf_greedy(hf_model, prompt, 16) for prompt in SHARING]


def test_the_next_turn_hits_inside_the_answer(saved: tuple[Path, torch.nn.Module]) -> None:
    """A finished answer leaves its end state: a second turn (prompt, answer, new message)
    hits all 45 tokens the first computed (its last token never is), where the prompt's
    checkpoints alone give 28."""
    path, hf_model = saved
    llm = LLM(str(path), prefix_match_unit=4, **LLM_ARGS)
    try:
        (answer,), _ = _run(llm, [FIRST], GREEDY)
        turn = [*FIRST, *answer, 1, 2, 3]
        tokens, hits = _run(llm, [turn], GREEDY)
    finally:
        llm.shutdown()
    assert hits == [45]
    assert tokens == [hf_greedy(hf_model, turn, 16)]


def test_seeded_samples_with_hits_equal_a_cold_engine(saved: tuple[Path, torch.nn.Module]) -> None:
    path, _ = saved
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    cold = LLM(str(path), enable_prefix_caching=False, **LLM_ARGS)
    try:
        expected, _ = _run(cold, SHARING, params)
    finally:
        cold.shutdown()
    llm = LLM(str(path), prefix_match_unit=4, **LLM_ARGS)
    try:
        _run(llm, [FIRST], GREEDY)
        tokens, hits = _run(llm, SHARING, params)
        _, block_grid_hits = _run(llm, [[*FIRST[:12], 1, 2, 3]], GREEDY)
    finally:
        llm.shutdown()
    assert hits == [8, 20]
    assert block_grid_hits == [12]
    assert tokens == expected


@pytest.mark.parametrize("mode", ["align", "all"])
def test_gated_deltanet_hits_inside_a_block_give_transformers_tokens(
    tmp_path: Path, mode: str
) -> None:
    """The checkpoints are generic over state layers: a tiny Qwen3-Next (gated DeltaNet, 8-token
    hybrid blocks) hits at 8 and 20 shared tokens with transformers' greedy tokens."""
    hf_model = save_tiny_linear_hybrid("qwen3_next", tmp_path)
    llm = LLM(str(tmp_path), prefix_match_unit=4, mamba_cache_mode=mode, **LLM_ARGS)
    try:
        _run(llm, [FIRST], GREEDY)
        tokens, hits = _run(llm, SHARING, GREEDY)
    finally:
        llm.shutdown()
    assert hits == [8, 20]
    assert tokens == [hf_greedy(hf_model, prompt, 16) for prompt in SHARING]

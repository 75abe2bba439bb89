"""A chat's next turn hits the previous turn's tokens with default settings, on recurrent-state
hybrids whose unified blocks are longer than the configured 16 tokens.

Tiny random Bamba, Nemotron-H, Qwen3.5 and LFM2 models (CPU fp32), default engine settings (block
16, async scheduling, `prefix_match_unit` unset): four turns, each the previous prompt, its answer
and a few new tokens. Every turn's greedy tokens equal transformers' own; turns 2-4 hit every
token the previous turn computed (its prompt and its answer but the last token), where the
block grid alone stops at the last unified block end. LFM2's state fits a 16-token page, so its
blocks stay 16 tokens long and it hits on that grid like an attention-only model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import hf_greedy

pytestmark = pytest.mark.parity

FIRST = [(11 * i + 5) % 256 for i in range(37)]
ANSWER_TOKENS = 9
NEW_TOKENS = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS)
FAMILIES = {
    "bamba": (save_tiny_hybrid, {"mamba_d_state": 32}),
    "nemotron_h": (save_tiny_hybrid, {"ssm_state_size": 32}),
    "qwen3_5": (save_tiny_linear_hybrid, {"linear_key_head_dim": 16, "linear_value_head_dim": 32}),
    "lfm2": (save_tiny_linear_hybrid, None),
}
"""Family -> (checkpoint writer, the sizes that make a layer's state larger than a 16-token
attention page, as in the released models: unified blocks of 48 tokens; None: blocks of 16)."""


@pytest.mark.parametrize(
    ("family", "mode"), [*((family, "align") for family in FAMILIES), ("bamba", "all")]
)
def test_each_turn_resumes_where_the_last_one_ended(family: str, mode: str, tmp_path: Path) -> None:
    """`mode`: mamba_cache_mode (align, the default; all keeps a state at every block end)."""
    save, state_sizes = FAMILIES[family]
    hf_model = save(family, tmp_path, **(state_sizes or {}))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=1 << 22, mamba_cache_mode=mode)
    prompt, computed, hits = FIRST, 0, []
    try:
        for new in [[], *NEW_TOKENS]:
            prompt = [*prompt, *new]
            (result,) = llm.generate([prompt], GREEDY, use_tqdm=False)
            answer = list(result.outputs[0].token_ids)
            assert answer == hf_greedy(hf_model, prompt, ANSWER_TOKENS)
            if computed:
                hits.append(result.num_cached_tokens)
            computed = len(prompt) + len(answer) - 1
            prompt = [*prompt, *answer]
    finally:
        llm.shutdown()
    previous = [len(FIRST) + ANSWER_TOKENS - 1]
    for new in NEW_TOKENS[:-1]:
        previous.append(previous[-1] + 1 + len(new) + ANSWER_TOKENS - 1)
    expected = previous if state_sizes else [p // 16 * 16 for p in previous]
    assert hits == expected

"""Speculative decoding keeps greedy tokens identical to decoding without it, on every hybrid
layout, with prefix caching on (CPU fp32, tiny random models, the offline `LLM`).

Per layout and k in {1, 2, 4} (and k = 2 with async scheduling), one engine runs the same
prompts (chunked prefill; prompts that share prefixes, so later rounds hit the cache that
speculative rounds filled) with four drafters: n-gram, the target's own continuation (every
draft accepted), a perturbed one (some rejected) and random tokens (almost all rejected).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from cluster import LLM, SamplingParams
from tests.helpers.drafters import ScriptedProposer, install_proposer
from tests.helpers.engine_probe import engine_stats
from tests.helpers.tiny_gemma3n import save_tiny_gemma3n
from tests.helpers.tiny_gemma4_gpt_oss import GEMMA4, GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.parity

NUM_NEW = 20
BASE_PROMPT = [(7 * i + 3) % 256 for i in range(30)]
PROMPTS = [
    BASE_PROMPT,
    [1, 2, 3, 4, 5, 6] * 4,  # repetitive: n-gram drafts find matches
    [*BASE_PROMPT[:24], 9, 8, 7],  # shares 24 tokens with the first
]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 24,
    "kv_cache_memory_bytes": 1 << 22,
}
LAYOUTS = [
    "gemma3",  # sliding window
    "llama4",  # chunked local
    "gpt_oss",  # sliding window + sinks
    "gemma3n",  # KV sharing
    "gemma4",  # KV sharing (K = V donors), two page sizes
    "bamba",  # Mamba-2
    "nemotron_h",  # Mamba-2
    "qwen3_next",  # gated DeltaNet
    "qwen3_5",  # gated DeltaNet
    "lfm2",  # short conv
]


class Reference(NamedTuple):
    path: Path
    tokens: list[list[int]]
    """Greedy outputs of PROMPTS without speculation."""


def _save(layout: str, path: Path) -> None:
    if layout in ("gemma3", "llama4"):
        save_tiny_model(layout, path)
    elif layout in ("bamba", "nemotron_h"):
        save_tiny_hybrid(layout, path)
    elif layout in ("qwen3_next", "qwen3_5", "lfm2"):
        save_tiny_linear_hybrid(layout, path)
    elif layout == "gpt_oss":
        save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, path)
    elif layout == "gemma4":
        save_gemma4_or_gpt_oss("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4, path)
    else:
        save_tiny_gemma3n(path)


def _generate(llm: LLM) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=LAYOUTS)
def reference(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    path = tmp_path_factory.mktemp(request.param)
    _save(request.param, path)
    llm = LLM(str(path), **LLM_ARGS)
    tokens = _generate(llm)
    llm.shutdown()
    return Reference(path, tokens)


def _accepted(llm: LLM) -> tuple[int, int]:
    stats = engine_stats(llm).spec_decoding
    assert stats is not None
    return stats.num_accepted_tokens, stats.num_draft_tokens


@pytest.mark.parametrize(
    ("k", "async_scheduling"),
    [(1, False), (2, False), (4, False), (2, True)],
    ids=["1", "2", "4", "2-async"],
)
def test_greedy_tokens_equal_no_speculation(
    reference: Reference, k: int, async_scheduling: bool
) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": k}
    llm = LLM(
        str(reference.path),
        speculative_config=spec,
        async_scheduling=async_scheduling,
        **LLM_ARGS,
    )
    assert _generate(llm) == reference.tokens, "ngram"
    sequences = [[*p, *t] for p, t in zip(PROMPTS, reference.tokens, strict=True)]
    for kind in ("oracle", "perturbed", "random"):
        install_proposer(llm, ScriptedProposer(k, sequences, kind))
        accepted, drafted = _accepted(llm)
        assert _generate(llm) == reference.tokens, kind
        new_accepted, new_drafted = _accepted(llm)
        assert new_drafted > drafted, kind
        if kind == "oracle":
            assert new_accepted - accepted == new_drafted - drafted
        else:
            assert new_accepted - accepted < new_drafted - drafted
    switch = llm.client.core.scheduler.spec.switch
    assert switch.num_pauses > 0  # rejected drafts paused drafting; the tokens stayed the same
    metrics = {metric.name: metric for metric in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_draft_tokens"].value == new_drafted  # type: ignore[attr-defined]
    llm.client.core.scheduler.kv_cache_manager.check_invariants()
    llm.shutdown()

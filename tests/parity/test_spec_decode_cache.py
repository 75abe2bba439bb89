"""Speculative decoding and the KV cache of recurrent hybrids: every Mamba cache mode, prefix
caching off, fine state checkpoints and preemption, each with synchronous and with async steps,
TP = 2, and the A -> B -> A poisoning probe (CPU fp32, tiny random models, the offline `LLM`).
Greedy tokens must equal those without speculation; every case rejects drafts and restores the
recurrent states of the accepted position (a rollback), and runs ahead of its tokens exactly
when it schedules asynchronously."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from cluster import LLM, SamplingParams
from tests.helpers.drafters import ScriptedProposer, install_proposer
from tests.helpers.engine_probe import engine_stats, num_scheduled_ahead
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

pytestmark = pytest.mark.parity

NUM_NEW = 24
PROMPT_A = [(7 * i + 3) % 256 for i in range(30)]
PROMPT_B = [*PROMPT_A[:24], 9, 8, 7, 6]  # shares two hybrid blocks of 12 with A
PROMPTS = [PROMPT_A, [(11 * i + 5) % 256 for i in range(9)], PROMPT_B]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS: dict[str, Any] = {
    "block_size": 4,
    "max_num_batched_tokens": 24,
    "kv_cache_memory_bytes": 1 << 21,
}
CACHE_CASES: dict[str, dict[str, Any]] = {
    "align": {"mamba_cache_mode": "align"},
    "all": {"mamba_cache_mode": "all"},
    "no_caching": {"enable_prefix_caching": False},
    "checkpoints": {"prefix_match_unit": 4},
    "preemption": {"kv_cache_memory_bytes": 18 * 3072, "max_model_len": 72},
}
SCHEDULING = {"sync": False, "async": True}
"""Case name -> async_scheduling (set explicitly: the engine's default is async)."""


class Saved(NamedTuple):
    path: Path
    sequences: list[list[int]]
    """Prompt + greedy output without speculation, per prompt of PROMPTS."""


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=["bamba", "qwen3_next"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "bamba":
        save_tiny_hybrid("bamba", path)
    else:
        save_tiny_linear_hybrid("qwen3_next", path)
    llm = LLM(str(path), enable_prefix_caching=False, **LLM_ARGS)
    tokens = [_generate(llm, [prompt])[0] for prompt in PROMPTS]
    llm.shutdown()
    return Saved(path, [[*p, *t] for p, t in zip(PROMPTS, tokens, strict=True)])


def _expected(saved: Saved, prompts: list[list[int]]) -> list[list[int]]:
    by_prompt = {
        tuple(s[: len(p)]): s[len(p) :] for p, s in zip(PROMPTS, saved.sequences, strict=True)
    }
    return [by_prompt[tuple(prompt)] for prompt in prompts]


@contextmanager
def count_state_restores(llm: LLM) -> Iterator[list[int]]:
    """Yield a list that receives, per rollback of a request's recurrent states to a draft
    position's slot (drafts rejected), the number of drafts accepted."""
    slots = llm.client.core.scheduler.kv_cache_manager.spec_slots
    assert slots is not None, "no draft-position state slots: not a recurrent hybrid"
    restore = slots.restore
    seen: list[int] = []

    def recording_restore(req_id: str, num_accepted: int, num_computed: int) -> None:
        seen.append(num_accepted)
        restore(req_id, num_accepted, num_computed)

    slots.restore = recording_restore  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del slots.restore


@pytest.mark.parametrize("scheduling", list(SCHEDULING))
@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_cache_modes_and_preemption_keep_the_tokens(
    saved: Saved, case: str, scheduling: str
) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    args = {**LLM_ARGS, **CACHE_CASES[case], "async_scheduling": SCHEDULING[scheduling]}
    llm = LLM(str(saved.path), speculative_config=spec, **args)
    with count_state_restores(llm) as restores:
        for kind in ("oracle", "perturbed"):
            install_proposer(llm, ScriptedProposer(3, saved.sequences, kind))
            assert _generate(llm, PROMPTS) == _expected(saved, PROMPTS), kind
    stats = engine_stats(llm)
    ahead = num_scheduled_ahead(llm)
    llm.client.core.scheduler.kv_cache_manager.check_invariants()
    llm.shutdown()
    assert (ahead > 0) == SCHEDULING[scheduling], ahead  # which scheduling ran
    spec_stats = stats.spec_decoding
    assert spec_stats is not None
    assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens  # drafts rejected
    assert restores, "no rollback restored a draft position's recurrent states"
    assert (stats.num_preemptions > 0) == (case == "preemption")


def test_a_then_b_then_a_gives_a_the_same_answer(saved: Saved) -> None:
    """Prompt A, then B sharing A's prefix, then A again, each alone: A's answers equal, over
    20 rounds of drafts that are mostly rejected (a stale draft state would poison the cache)."""
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    llm = LLM(str(saved.path), speculative_config=spec, **LLM_ARGS)
    llm.client.core.scheduler.spec.switch = None  # rejected drafts stay verified every step
    (answer_a,) = _expected(saved, [PROMPT_A])
    for round_index in range(20):
        kind = "perturbed" if round_index % 2 else "random"
        install_proposer(llm, ScriptedProposer(4, saved.sequences, kind))
        assert _generate(llm, [PROMPT_A]) == [answer_a], round_index
        assert _generate(llm, [PROMPT_B]) == _expected(saved, [PROMPT_B]), round_index
        assert _generate(llm, [PROMPT_A]) == [answer_a], round_index
    stats = engine_stats(llm)
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.spec_decoding is not None
    assert stats.spec_decoding.num_accepted_tokens < stats.spec_decoding.num_draft_tokens
    llm.shutdown()


def test_tensor_parallel_2_verifies_drafts_on_both_ranks(saved: Saved) -> None:
    """TP = 2 (a process per rank): recurrent heads split across ranks, each rank saves and
    restores its own draft-position states; greedy tokens equal TP = 1 without speculation."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,
    }
    llm = LLM(str(saved.path), speculative_config=spec, tensor_parallel_size=2, **LLM_ARGS)
    try:
        assert _generate(llm, PROMPTS) == _expected(saved, PROMPTS)
        stats = engine_stats(llm).spec_decoding
    finally:
        llm.shutdown()
    assert stats is not None
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # rejections: state restores

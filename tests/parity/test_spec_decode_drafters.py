"""Speculative decoding with a draft model and with the checkpoint's MTP layer keeps greedy
tokens identical to decoding without it (CPU fp32, tiny random models, the offline `LLM`).

The drafter's layers live in KV cache groups of their own in the shared pool: no group mixes
them with the target's, and every block is back in the pool when the requests are done. Draft
= target accepts every draft; a different random draft model and random MTP weights accept
(almost) none, and the outputs stay exact either way. Every MTP proposal is the one a plain
torch forward of the MTP layer's weights (transformers' modules) makes from the transformers
target's hidden states (`tests.helpers.tiny_mtp.ReferenceMtp`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster import LLM, SamplingParams
from tests.helpers.engine_probe import (
    engine_stats,
    kv_cache_groups,
    record_drafts,
    watch_preemptions,
)
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.tiny_mtp import ReferenceMtp, save_tiny_with_mtp

pytestmark = pytest.mark.parity

NUM_NEW = 10
PROMPTS = [[(7 * i + 3) % 256 for i in range(21)], [1, 2, 3, 4, 5, 6] * 3]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS: dict[str, Any] = {
    "block_size": 4,
    "max_num_batched_tokens": 16,  # the first prompt is prefilled in two chunks
    "kv_cache_memory_bytes": 1 << 22,
}


def _generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params, use_tqdm=False)]


def _reference(path: Path, **overrides: Any) -> list[list[int]]:
    llm = LLM(str(path), **{**LLM_ARGS, **overrides})
    tokens = _generate(llm)
    llm.shutdown()
    return tokens


def _run_speculative(path: Path, spec: dict[str, Any], **overrides: Any) -> tuple[Any, ...]:
    """(greedy tokens, accepted, drafted, preemptions, proposals: (tokens so far, drafts) per
    request drafted for) with `spec`, after checking the drafter's groups are its own and that
    no block stays held."""
    llm = LLM(str(path), speculative_config=spec, **{**LLM_ARGS, **overrides})
    with watch_preemptions(llm) as preemptions, record_drafts(llm) as proposals:
        tokens = _generate(llm)
    groups = kv_cache_groups(llm)
    assert any(is_drafter for is_drafter, _ in groups), "the drafter has no KV cache group"
    for is_drafter, layers in groups:
        assert layers, "a KV cache group without layers"
        assert all(name.startswith("drafter.") == is_drafter for name in layers), layers
    stats = engine_stats(llm)
    assert stats.kv_cache_usage == 0, "blocks still held after every request finished"
    llm.client.core.scheduler.kv_cache_manager.check_invariants()
    spec_stats = stats.spec_decoding
    assert spec_stats is not None
    llm.shutdown()
    accepted, drafted = spec_stats.num_accepted_tokens, spec_stats.num_draft_tokens
    return tokens, accepted, drafted, len(preemptions), proposals


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A sliding-window target, and its greedy tokens without speculation."""
    path = tmp_path_factory.mktemp("gemma3")
    save_tiny_model("gemma3", path)
    return path, _reference(path)


SELF_DRAFT_CASES: dict[str, dict[str, Any]] = {
    "caching": {},
    "no_caching": {"enable_prefix_caching": False},
    "preemption": {"kv_cache_memory_bytes": 64 << 10, "max_model_len": 40},  # 64 blocks
}


@pytest.mark.parametrize("case", list(SELF_DRAFT_CASES))
def test_self_draft_accepts_every_draft(gemma3: tuple[Path, list[list[int]]], case: str) -> None:
    path, reference = gemma3
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    tokens, accepted, drafted, preempted, _ = _run_speculative(path, spec, **SELF_DRAFT_CASES[case])
    assert tokens == reference
    assert drafted > 0
    assert accepted == drafted  # the drafter computes what the target does
    assert (preempted > 0) == (case == "preemption")


def test_random_draft_model_on_mamba_hybrid(tmp_path: Path) -> None:
    """A Bamba target (Mamba-2 groups) drafted by an unrelated tiny Llama."""
    target, draft = tmp_path / "bamba", tmp_path / "llama"
    save_tiny_hybrid("bamba", target)
    save_tiny_model("llama", draft, seed=3, max_position_embeddings=256)
    reference = _reference(target)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    tokens, accepted, drafted, _, _ = _run_speculative(target, spec)
    assert tokens == reference
    assert drafted > 0
    assert accepted < drafted / 2


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_mtp_drafts_as_its_reference_and_keeps_greedy_tokens(tmp_path: Path, family: str) -> None:
    """The MTP layer (random weights) on a gated-DeltaNet hybrid drafts what a plain torch
    forward of its weights on transformers' hidden states drafts, at every step (also after
    rejected drafts); outputs stay exact."""
    mtp = ReferenceMtp(save_tiny_with_mtp(family, tmp_path), tmp_path)
    reference = _reference(tmp_path)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    tokens, accepted, drafted, _, proposals = _run_speculative(tmp_path, spec)
    assert tokens == reference
    assert drafted > accepted  # drafts were rejected: later proposals follow a rollback
    assert len(proposals) >= len(PROMPTS) * (NUM_NEW // 2)
    for known, drafts in proposals:
        assert drafts == mtp.drafts(known, 2), known


def test_seeded_sampling_with_draft_model_is_reproducible(
    gemma3: tuple[Path, list[list[int]]],
) -> None:
    path, _ = gemma3
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    llm = LLM(str(path), speculative_config=spec, **LLM_ARGS)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=NUM_NEW)
    first, second = _generate(llm, seeded), _generate(llm, seeded)
    llm.shutdown()
    assert first == second


def _start_error(path: Path, spec: dict[str, Any]) -> str:
    with pytest.raises(ValueError, match=r"^speculative_config") as info:
        LLM(str(path), speculative_config=spec, **LLM_ARGS)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_drafters_that_cannot_draft_fail_at_start(
    gemma3: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    path, _ = gemma3
    assert "no MTP layers" in _start_error(path, {"method": "mtp", "num_speculative_tokens": 2})
    other_vocab = tmp_path / "vocab"
    save_tiny_model("llama", other_vocab, vocab_size=300)
    spec = {"method": "draft_model", "model": str(other_vocab), "num_speculative_tokens": 2}
    assert "vocabulary (300 tokens)" in _start_error(path, spec)


def _spec_run(path: Path, spec: dict[str, Any], **overrides: Any) -> tuple[list[list[int]], Any]:
    """Greedy tokens and acceptance counters (e.g. with tensor_parallel_size 2: a process per
    rank)."""
    llm = LLM(str(path), speculative_config=spec, **{**LLM_ARGS, **overrides})
    try:
        return _generate(llm), engine_stats(llm).spec_decoding
    finally:
        llm.shutdown()


def test_tensor_parallel_2_self_draft_of_a_mamba_hybrid(tmp_path: Path) -> None:
    """A Bamba target drafting for itself, both sharded over two ranks: every draft accepted
    (each rank's drafter shard computes what the target's does), tokens those of TP = 1."""
    save_tiny_hybrid("bamba", tmp_path)
    reference = _reference(tmp_path)
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2}
    tokens, stats = _spec_run(tmp_path, spec, tensor_parallel_size=2)
    assert tokens == reference
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_tensor_parallel_2_mtp_drafts_as_one_rank(tmp_path: Path) -> None:
    """Qwen3.5's MTP layer sharded over two ranks drafts what it drafts on one (the same
    acceptance counts), and tokens are those of TP = 1 without speculation."""
    save_tiny_with_mtp("qwen3_5", tmp_path)
    reference = _reference(tmp_path)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    one_rank = _spec_run(tmp_path, spec)
    tokens, stats = _spec_run(tmp_path, spec, tensor_parallel_size=2)
    assert tokens == reference
    assert stats.num_draft_tokens > 0
    assert (tokens, stats) == one_rank

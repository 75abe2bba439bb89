"""Speculative decoding and sampling through the offline `LLM` (tiny random Llama, CPU fp32):
logprobs of emitted tokens equal those of plain decoding, seeded random sampling repeats, and
requests with penalties decode exactly as without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, RequestOutput, SamplingParams
from tests.helpers.drafters import ScriptedProposer, install_proposer
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.parity

PROMPTS = [[(7 * i + 3) % 256 for i in range(20)], [1, 2, 3, 4, 5, 6] * 3]
ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 32,
    "kv_cache_memory_bytes": 1 << 22,
}
SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    return path


def _plain_then_speculative(
    llama: Path, params: SamplingParams, kind: str
) -> tuple[list[RequestOutput], LLM]:
    """`params`' outputs for PROMPTS without speculation, and an `LLM` with speculation whose
    proposer drafts those outputs, altered by `kind` (the caller shuts it down)."""
    plain = LLM(str(llama), **ARGS)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    plain.shutdown()
    sequences = [[*p, *r.outputs[0].token_ids] for p, r in zip(PROMPTS, expected, strict=True)]
    llm = LLM(str(llama), speculative_config=SPEC, **ARGS)
    install_proposer(llm, ScriptedProposer(3, sequences, kind))
    return expected, llm


def test_logprobs_of_accepted_tokens_equal_plain_decoding(llama: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3)
    expected, llm = _plain_then_speculative(llama, params, "perturbed")
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.client.get_stats().spec_decoding
    llm.shutdown()
    assert stats is not None
    assert stats.num_accepted_tokens > 0  # some emitted tokens came from accepted drafts
    for ours, theirs in zip(results, expected, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        ours_lp, theirs_lp = ours.outputs[0].logprobs, theirs.outputs[0].logprobs
        assert ours_lp is not None
        assert theirs_lp is not None
        assert len(ours_lp) == len(theirs_lp) == 16
        for mine, ref in zip(ours_lp, theirs_lp, strict=True):
            assert mine.keys() == ref.keys()
            for token in ref:
                assert abs(mine[token].logprob - ref[token].logprob) < 1e-4


def test_seeded_random_sampling_repeats_and_penalties_stay_exact(llama: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16)
    penalised = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=16)
    expected, llm = _plain_then_speculative(llama, penalised, "oracle")
    runs = [
        [r.outputs[0].token_ids for r in llm.generate(PROMPTS, seeded, use_tqdm=False)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    drafted = llm.client.get_stats().spec_decoding
    assert drafted is not None
    assert drafted.num_drafts > 0  # the seeded runs verified drafts
    penalised_out = llm.generate(PROMPTS, penalised, use_tqdm=False)
    assert [r.outputs[0].token_ids for r in penalised_out] == [
        r.outputs[0].token_ids for r in expected
    ]
    assert llm.client.get_stats().spec_decoding == drafted  # penalties: no drafts verified
    llm.shutdown()


def test_n_samples_per_prompt_verify_drafts_each(llama: Path) -> None:
    """`n > 1`: every sample of a prompt drafts and verifies on its own; greedy samples equal
    plain decoding, seeded random ones repeat."""
    greedy = SamplingParams(temperature=0, max_tokens=16, n=3)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=16, n=2)
    expected, llm = _plain_then_speculative(llama, greedy, "perturbed")
    results = llm.generate(PROMPTS, greedy, use_tqdm=False)
    for ours, theirs in zip(results, expected, strict=True):
        assert len(ours.outputs) == 3
        assert all(o.token_ids == theirs.outputs[0].token_ids for o in ours.outputs)
    stats = llm.client.get_stats().spec_decoding
    assert stats is not None
    assert stats.num_drafts >= 3 * len(PROMPTS)  # every sample verified drafts
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    runs = [
        [[o.token_ids for o in r.outputs] for r in llm.generate(PROMPTS, seeded, use_tqdm=False)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    llm.shutdown()

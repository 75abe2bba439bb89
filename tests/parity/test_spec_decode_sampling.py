"""Speculative decoding and sampling through the offline `LLM` (tiny random Llama, CPU fp32):
random sampling with speculation follows the target's distribution computed from transformers'
logits, logprobs of emitted tokens equal those of plain decoding, seeded random sampling
repeats, and requests with penalties decode exactly as without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

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
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    """The tiny Llama's folder and its transformers model."""
    path = tmp_path_factory.mktemp("llama")
    return path, save_tiny_model("llama", path)


@pytest.fixture(scope="module")
def llama(llama_model: tuple[Path, PreTrainedModel]) -> Path:
    return llama_model[0]


NUM_SAMPLES = 96
"""Samples per prompt of the distribution test (1536 drawn tokens in all)."""
SHARP = SamplingParams(temperature=0.2, top_k=8, max_tokens=8, n=NUM_SAMPLES)
"""The tiny model's best token has about half the mass: drafts of it are accepted about half
the time, so some verify steps accept all three drafts and emit the bonus token."""
RANK_BUCKETS = 4
"""Emitted tokens are counted by their rank in the target's distribution: 1st, 2nd, 3rd, other."""


def _target_probs(hf_model: PreTrainedModel, sequences: list[list[int]]) -> torch.Tensor:
    """[num_sequences, len - 1, vocab]: transformers' distribution of each next token under
    SHARP (temperature, then top-k), computed here rather than by the engine's sampler."""
    with torch.no_grad():
        logits = hf_model(torch.tensor(sequences)).logits[:, :-1].float()
    scaled = logits / SHARP.temperature
    kth_best = scaled.topk(SHARP.top_k, dim=-1).values[..., -1:]
    return torch.softmax(scaled.masked_fill(scaled < kth_best, float("-inf")), dim=-1)


def _rank_histograms(
    probs: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(observed, expected) shares of the rank buckets of `tokens` [N] drawn from `probs`
    [N, vocab]: expected is the mass the target gives each bucket, averaged over the draws."""
    order = probs.argsort(dim=-1, descending=True)
    ranks = (order == tokens[:, None]).float().argmax(dim=-1).clamp(max=RANK_BUCKETS - 1)
    observed = torch.bincount(ranks, minlength=RANK_BUCKETS).double() / len(tokens)
    by_rank = probs.gather(1, order).double()
    expected = torch.cat(
        [by_rank[:, : RANK_BUCKETS - 1], by_rank[:, RANK_BUCKETS - 1 :].sum(-1, keepdim=True)],
        dim=-1,
    ).mean(0)
    return observed, expected


def test_sampled_tokens_with_speculation_follow_the_target_distribution(
    llama_model: tuple[Path, PreTrainedModel],
) -> None:
    """The model drafts for itself (greedy drafts: its best token); every emitted token's rank
    in transformers' distribution of it given the tokens before it (the target's distribution,
    with SHARP's temperature and top-k) is counted: the counts' total variation from the ranks'
    expected shares is within sampling noise (0.006 to 0.027 over 12 sampler seeds; accepting
    drafts 1.2 times as often as the rule does gives 0.056 to 0.072)."""
    path, hf_model = llama_model
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = LLM(str(path), speculative_config=spec, **{**ARGS, "max_num_batched_tokens": 256})
    results = llm.generate(PROMPTS, SHARP, use_tqdm=False)
    stats = llm.client.get_stats().spec_decoding
    llm.shutdown()
    assert stats is not None
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected
    assert stats.num_accepted_tokens_per_pos[-1] > 0  # bonus tokens after all drafts
    probs, tokens = [], []
    for prompt, result in zip(PROMPTS, results, strict=True):
        outputs = [list(o.token_ids) for o in result.outputs]
        assert len(outputs) == NUM_SAMPLES
        assert {len(o) for o in outputs} == {SHARP.max_tokens}
        sequences = [[*prompt, *o] for o in outputs]
        probs.append(_target_probs(hf_model, sequences)[:, len(prompt) - 1 :].flatten(0, 1))
        tokens.append(torch.tensor(outputs).flatten())
    observed, expected = _rank_histograms(torch.cat(probs), torch.cat(tokens))
    total_variation = float((observed - expected).abs().sum() / 2)
    assert total_variation < 0.05, (observed, expected)


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

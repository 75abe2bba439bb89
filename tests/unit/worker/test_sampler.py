"""Sampler: masks against a direct per-row computation, seeds, draws, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from scheduler.request import SamplingParams
from worker.sampler import (
    Sampler,
    SamplingTensors,
    apply_min_p,
    apply_top_k_top_p,
    to_token_logprobs,
)

CPU = torch.device("cpu")
VOCAB = 50


def _tensors(params: list[SamplingParams], generators=None) -> SamplingTensors:
    generators = generators or [None] * len(params)
    return SamplingTensors.build(params, generators, VOCAB, CPU)


def _kept_direct(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Tokens kept by top-k then top-p, computed token by token."""
    order = sorted(range(len(row)), key=lambda t: -float(row[t]))
    kept = order[:top_k]
    probs = torch.softmax(row[kept].double(), dim=0).tolist()
    result, mass = [], 0.0
    for token, prob in zip(kept, probs, strict=True):
        if result and mass >= top_p:
            break
        result.append(token)
        mass += prob
    return set(result)


@pytest.mark.parametrize(("top_k", "top_p"), [(VOCAB, 0.3), (5, 1.0), (7, 0.6), (1, 0.9)])
def test_top_k_top_p_mask_matches_direct_computation(top_k: int, top_p: float) -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(top_k))
    out = apply_top_k_top_p(
        logits, torch.full((6,), top_k), torch.full((6,), top_p, dtype=torch.float32)
    )
    for row in range(6):
        kept = set(torch.nonzero(out[row] > float("-inf")).flatten().tolist())
        assert kept == _kept_direct(logits[row], top_k, top_p)
        assert torch.equal(out[row][list(kept)], logits[row][list(kept)])


def test_min_p_mask_matches_direct_computation() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    out = apply_min_p(logits, min_p)
    for row in range(4):
        probs = torch.softmax(logits[row].double(), dim=0)
        expected = {t for t in range(VOCAB) if probs[t] >= min_p[row] * probs.max()}
        assert set(torch.nonzero(out[row] > float("-inf")).flatten().tolist()) == expected


def test_greedy_rows_take_the_argmax_in_a_mixed_batch() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
    ]
    out = Sampler(seed=0, device=CPU).sample(logits, _tensors(params))
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[2] == logits[2].argmax()
    assert out.logprobs == [None, None, None]


def test_top_k_1_is_greedy_and_restricted_sampling_stays_in_the_kept_set() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_k=3)]
    sampler = Sampler(seed=0, device=CPU)
    top3 = set(logits[1].topk(3).indices.tolist())
    for _ in range(20):
        out = sampler.sample(logits, _tensors(params))
        assert out.token_ids[0] == logits[0].argmax()
        assert int(out.token_ids[1]) in top3


def test_draws_follow_the_tempered_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(temperature=1.0)]
    tensors = SamplingTensors.build(params, [None], 4, CPU)
    sampler = Sampler(seed=0, device=CPU)
    draws = torch.stack([sampler.sample(logits, tensors).token_ids[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
    hot = SamplingTensors.build([SamplingParams(temperature=0.25)], [None], 4, CPU)
    draws = torch.stack([sampler.sample(logits, hot).token_ids[0] for _ in range(2000)])
    expected = torch.softmax(logits[0] / 0.25, dim=0)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert torch.allclose(freq, expected, atol=0.03)


def test_seeded_requests_reproduce_regardless_of_batch_and_global_state() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def run(rows: list[int], sampler_seed: int, params: list[SamplingParams]) -> list[int]:
        sampler = Sampler(seed=sampler_seed, device=CPU)
        generators = [
            torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params
        ]
        tensors = _tensors(params, generators)
        picked = []
        for _ in range(8):
            out = sampler.sample(logits[rows], tensors)
            picked.append(int(out.token_ids[params.index(seeded)]))
        return picked

    alone = run([0], 0, [seeded])
    assert run([1, 0], 99, [other, seeded]) == alone
    assert run([0, 2], 7, [seeded, other]) == alone
    assert len(set(alone)) > 1  # really sampled, not argmax


def test_sample_logprobs_match_log_softmax_with_rank() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, logprobs=3), SamplingParams(temperature=0)]
    out = Sampler(seed=0, device=CPU).sample(logits, _tensors(params))
    entry = out.logprobs[0]
    assert entry is not None
    assert out.logprobs[1] is None
    reference = torch.log_softmax(logits[0].double(), dim=0)
    token = int(out.token_ids[0])
    assert entry.token_id == token
    assert math.isclose(entry.logprob, float(reference[token]), abs_tol=1e-5)
    assert entry.rank == int((reference > reference[token]).sum()) + 1
    assert entry.top_token_ids == reference.topk(3).indices.tolist()
    assert entry.top_logprobs == pytest.approx(reference.topk(3).values.tolist(), abs=1e-5)


def test_prompt_logprobs_of_given_targets() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    targets = torch.tensor([4, 9, 0])
    entries = to_token_logprobs(logits, targets, [0, 0, 0])
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, entry in enumerate(entries):
        assert entry.token_id == int(targets[row])
        assert math.isclose(entry.logprob, float(reference[row, targets[row]]), abs_tol=1e-5)
        assert entry.top_token_ids == []
        assert entry.top_logprobs == []
        assert entry.rank == int((reference[row] > reference[row, targets[row]]).sum()) + 1


def test_banned_tokens_are_never_drawn_but_keep_raw_logprobs() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(6))
    best = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=1.0, top_k=2)]
    tensors = SamplingTensors.build(params, [None, None], VOCAB, CPU, [[best[0]], [best[1]]])
    second_and_third = set(logits[1].topk(3).indices.tolist()[1:])
    sampler = Sampler(seed=0, device=CPU)
    drawn = set()
    for _ in range(20):
        out = sampler.sample(logits, tensors)
        assert out.token_ids[0] == logits[0].topk(2).indices[1]
        drawn.add(int(out.token_ids[1]))
    assert drawn == second_and_third  # top-2 of what is allowed: the banned best is gone
    entry = out.logprobs[0]
    assert entry is not None
    assert entry.rank == 2
    assert entry.top_token_ids == [best[0]]


def test_more_logprobs_than_the_vocabulary_returns_the_whole_vocabulary() -> None:
    """logprobs=20 on a 16-token vocabulary (tiny test models) gives all 16, best first."""
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=0, logprobs=20)]
    tensors = SamplingTensors.build(params, [None], 16, CPU)
    entry = Sampler(seed=0, device=CPU).sample(logits, tensors).logprobs[0]
    assert entry is not None
    reference = torch.log_softmax(logits[0].double(), dim=0)
    assert entry.top_token_ids == reference.argsort(descending=True).tolist()
    assert entry.top_logprobs == pytest.approx(reference.sort(descending=True).values.tolist())


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40])
def test_tiny_temperatures_are_greedy_instead_of_overflowing(temperature: float) -> None:
    """Dividing logits by 1e-40 overflows fp32 to inf and the softmax to NaN."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(8)) * 5
    params = [SamplingParams(temperature=temperature), SamplingParams(temperature=1.0)]
    out = Sampler(seed=0, device=CPU).sample(logits, _tensors(params))
    assert out.token_ids[0] == logits[0].argmax()

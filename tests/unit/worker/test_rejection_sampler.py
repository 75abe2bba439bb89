"""The verifier's rejection sampler: emitted tokens are distributed exactly as the target's
sampling distribution (total variation below 0.01 over 10^5 draws), whatever the drafts; greedy
rows accept exactly the argmax prefix; seeded rows repeat."""

from __future__ import annotations

import pytest
import torch

from scheduler.request import SamplingParams
from worker.sampler import SamplingTensors
from worker.spec_decode.rejection_sampler import VerifyRows, rejection_sample, target_probs

VOCAB = 6
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -3.0])
NUM_DRAWS = 100_000
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.6},
    {"temperature": 1.7},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.2, "top_k": 4, "top_p": 0.9, "min_p": 0.05},
]


def _tensors(params: SamplingParams, num_rows: int, seeded: bool = False) -> SamplingTensors:
    generators = [None] * num_rows
    if seeded:
        generator = torch.Generator()
        generator.manual_seed(7)
        generators = [generator] * num_rows
    return SamplingTensors.build([params] * num_rows, generators, VOCAB, torch.device("cpu"))


def _first_tokens(
    params: SamplingParams, drafts: torch.Tensor, q: torch.Tensor | None
) -> list[int]:
    """The first emitted token of NUM_DRAWS requests with one draft each (2 rows each)."""
    rows = VerifyRows.build([[int(d)] for d in drafts], torch.device("cpu"))
    num_rows = 2 * NUM_DRAWS
    tensors = _tensors(params, num_rows)
    probs = target_probs(LOGITS.expand(num_rows, VOCAB).clone(), tensors)
    draft_probs = None if q is None else q.expand(num_rows, VOCAB).clone()
    generator = torch.Generator()
    generator.manual_seed(0)
    emitted = rejection_sample(probs, rows, tensors, generator, draft_probs)
    return [tokens[0] for tokens in emitted]


def _total_variation(tokens: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / len(tokens)
    return float((counts - expected.double()).abs().sum() / 2)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", ["fixed_token", "one_hot_uniform", "draft_distribution"])
def test_emitted_tokens_follow_the_target_distribution(setting: dict, drafter: str) -> None:
    params = SamplingParams(**setting)
    target = target_probs(LOGITS[None], _tensors(params, 1))[0]
    generator = torch.Generator()
    generator.manual_seed(1)
    q = None
    if drafter == "fixed_token":
        drafts = torch.full((NUM_DRAWS,), 1)
    elif drafter == "one_hot_uniform":
        drafts = torch.randint(VOCAB, (NUM_DRAWS,), generator=generator)
    else:
        q = torch.softmax(torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 0.5]), dim=-1)
        drafts = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=generator)
    tokens = _first_tokens(params, drafts, q)
    assert _total_variation(tokens, target) < 0.01


def test_greedy_rows_accept_the_argmax_prefix_then_correct() -> None:
    logits = torch.tensor([[0.0, 3.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    tensors = SamplingTensors.build(
        [SamplingParams(temperature=0)] * 4, [None] * 4, 3, torch.device("cpu")
    )
    rows = VerifyRows.build([[1, 2, 0]], torch.device("cpu"))  # argmaxes: 1, 0, 2, 0
    emitted = rejection_sample(target_probs(logits, tensors), rows, tensors, torch.Generator())
    assert emitted == [[1, 0]]  # d1 = 1 accepted; d2 = 2 rejected for the argmax 0
    all_right = VerifyRows.build([[1, 0, 2]], torch.device("cpu"))
    emitted = rejection_sample(target_probs(logits, tensors), all_right, tensors, torch.Generator())
    assert emitted == [[1, 0, 2, 0]]  # every draft accepted, then the bonus token


def test_seeded_requests_repeat_their_tokens() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    drafts = [[int(t) for t in torch.randint(VOCAB, (3,))] for _ in range(8)]
    results = []
    for _ in range(2):
        rows = VerifyRows.build(drafts, torch.device("cpu"))
        tensors = _tensors(params, 32, seeded=True)
        probs = target_probs(LOGITS.expand(32, VOCAB).clone(), tensors)
        results.append(rejection_sample(probs, rows, tensors, torch.Generator()))
    assert results[0] == results[1]

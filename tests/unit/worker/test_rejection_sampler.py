"""The verifier's rejection sampler: at every emitted position of a verify step (after each
of k = 3 drafts, and the bonus token after all of them) tokens are distributed exactly as the
target's sampling distribution there, computed here from the logits and sampling settings
rather than by the sampler (total variation within a few standard errors of the draws that
reach the position), whatever the drafts; greedy rows accept exactly the argmax prefix; seeded
rows repeat."""

from __future__ import annotations

import math

import pytest
import torch

from scheduler.request import SamplingParams
from worker.sampler import SamplingTensors
from worker.spec_decode.rejection_sampler import VerifyRows, rejection_sample, target_probs

VOCAB = 6
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -3.0])
NUM_DRAFTS = 3
POSITION_LOGITS = torch.stack([LOGITS.roll(j) for j in range(NUM_DRAFTS + 1)])
"""The target's logits at each verified row of a request (each position its own best token)."""
DRAFT_LOGITS = torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 0.5])
NUM_REQUESTS = 40_000
STANDARD_ERRORS = 3.0
"""Total variation allowed at a position reached n times: this many times 1 / sqrt(n) (about
three times its expected value for 6 tokens)."""
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


def _reference_probs(logits: torch.Tensor, setting: dict) -> torch.Tensor:
    """The distribution sampling with `setting` draws from, token by token: temperature; tokens
    below min_p times the best probability dropped; the top_k best kept; of those, the best
    ones until their mass reaches top_p of the kept mass (the best always kept)."""
    probs = torch.softmax(logits / setting["temperature"], dim=-1).tolist()
    best_first = sorted(range(VOCAB), key=lambda token: -probs[token])
    kept = [t for t in best_first if probs[t] >= setting.get("min_p", 0.0) * max(probs)]
    kept = kept[: setting.get("top_k", VOCAB)]
    mass = sum(probs[t] for t in kept)
    head: list[int] = []
    for token in kept:
        if head and sum(probs[t] for t in head) >= setting.get("top_p", 1.0) * mass:
            break
        head.append(token)
    out = torch.zeros(VOCAB)
    out[head] = torch.tensor([probs[t] for t in head])
    return out / out.sum()


def _drafts(drafter: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[NUM_REQUESTS, NUM_DRAFTS] drafts, and per position the draft's distribution (None:
    one-hot drafts)."""
    if drafter == "best_token":  # the position's best token: many requests reach the bonus
        best = POSITION_LOGITS[:NUM_DRAFTS].argmax(dim=-1)
        return best.expand(NUM_REQUESTS, NUM_DRAFTS), None
    if drafter == "one_hot_uniform":
        return torch.randint(VOCAB, (NUM_REQUESTS, NUM_DRAFTS), generator=generator), None
    q = torch.softmax(torch.stack([DRAFT_LOGITS.roll(j) for j in range(NUM_DRAFTS)]), dim=-1)
    columns = [
        torch.multinomial(q[j], NUM_REQUESTS, replacement=True, generator=generator)
        for j in range(NUM_DRAFTS)
    ]
    return torch.stack(columns, dim=1), q


def _emitted(
    params: SamplingParams, drafts: torch.Tensor, q: torch.Tensor | None
) -> list[list[int]]:
    """Per request (NUM_DRAFTS drafts each, NUM_DRAFTS + 1 rows), the tokens emitted."""
    rows = VerifyRows.build(drafts.tolist(), torch.device("cpu"))
    num_rows = NUM_REQUESTS * (NUM_DRAFTS + 1)
    tensors = _tensors(params, num_rows)
    logits = POSITION_LOGITS.repeat(NUM_REQUESTS, 1)
    probs = target_probs(logits, tensors)
    draft_probs = None
    if q is not None:  # the last row of a request has no draft: any distribution
        draft_probs = torch.cat([q, torch.full((1, VOCAB), 1 / VOCAB)]).repeat(NUM_REQUESTS, 1)
    generator = torch.Generator()
    generator.manual_seed(0)
    return rejection_sample(probs, rows, tensors, generator, draft_probs)


def _total_variation(tokens: list[int], expected: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double() / len(tokens)
    return float((counts - expected.double()).abs().sum() / 2)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafter", ["best_token", "one_hot_uniform", "draft_distribution"])
def test_every_emitted_position_follows_the_target_distribution(
    setting: dict, drafter: str
) -> None:
    generator = torch.Generator()
    generator.manual_seed(1)
    drafts, q = _drafts(drafter, generator)
    emitted = _emitted(SamplingParams(**setting), drafts, q)
    for position in range(NUM_DRAFTS + 1):  # the last: the bonus token after every draft
        tokens = [request[position] for request in emitted if len(request) > position]
        assert tokens, f"no request reached position {position + 1}"
        expected = _reference_probs(POSITION_LOGITS[position], setting)
        tolerance = STANDARD_ERRORS / math.sqrt(len(tokens))
        assert _total_variation(tokens, expected) < tolerance, (position, len(tokens))


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

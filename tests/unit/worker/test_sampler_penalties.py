"""Penalties, logit bias, allowed tokens and bad words: the batched edits against a direct
per-token computation and against transformers' logits processors, in mixed batches, with the
per-request state maintained across steps."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from scheduler.output import CachedRequestData, SchedulerOutput
from scheduler.request import SamplingParams
from worker.input_batch import CachedRequestState
from worker.logits_processors import BadWordPatterns, bad_word_bans, process_logits
from worker.sampler import Sampler
from worker.sampling_state import SamplingState

CPU = torch.device("cpu")
VOCAB = 40
EOS = 39


def _req(req_id: str, prompt: list[int], output: list[int], **params) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        token_ids=[*prompt, *output],
        num_computed_tokens=0,
        block_ids=([],),
        sampling_params=SamplingParams(**params),
        generator=None,
    )


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _processed(state: SamplingState, reqs: list[CachedRequestState], logits: torch.Tensor):
    tensors = state.build(reqs, VOCAB)
    return process_logits(logits, tensors.banned, tensors.adjustments)


def _direct_penalties(row: torch.Tensor, req: CachedRequestState) -> torch.Tensor:
    """Token by token, as the OpenAI and CTRL/vLLM definitions read."""
    params = req.sampling_params
    output = req.token_ids[len(req.prompt_token_ids) :]
    values = row.tolist()
    for token in range(VOCAB):
        value = values[token]
        if token in req.token_ids:
            penalty = params.repetition_penalty
            value = value / penalty if value > 0 else value * penalty
        count = output.count(token)
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (count > 0)
        values[token] = value
    return torch.tensor(values)


def test_penalties_match_a_direct_computation_in_a_mixed_batch() -> None:
    reqs = [
        _req("plain", [1, 2, 3], [4, 4, 5], temperature=0),
        _req("rep", [1, 2, 3, 3], [4, 4, 5, 7], repetition_penalty=1.7),
        _req("freq", [6, 8], [9, 9, 9, 10], frequency_penalty=0.8, temperature=0),
        _req("pres", [6, 8], [9, 9, 11], presence_penalty=-1.5),
        _req("all", [0, 12], [12, 13, 13], repetition_penalty=0.6, frequency_penalty=-2.0,
             presence_penalty=2.0, temperature=0.5),
    ]  # fmt: skip
    logits = _logits(len(reqs))
    out = _processed(SamplingState(CPU), reqs, logits)
    assert torch.equal(out[0], logits[0])  # a row without penalties is untouched
    for row in range(1, len(reqs)):
        torch.testing.assert_close(out[row], _direct_penalties(logits[row], reqs[row]))


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    prompt, output = [3, 5, 5, 8], [8, 20, 21]
    logits = _logits(2, seed=1)
    reqs = [_req("a", prompt, output, repetition_penalty=penalty), _req("b", [1], [2])]
    out = _processed(SamplingState(CPU), reqs, logits)
    # transformers penalises every token of input_ids (prompt + generated), as vLLM does.
    reference = RepetitionPenaltyLogitsProcessor(penalty)(
        torch.tensor([prompt + output]), logits[:1].clone()
    )
    torch.testing.assert_close(out[:1], reference)
    assert torch.equal(out[1], logits[1])


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    bias = {3: 5.0, 17: -2.5, 30: 100.0}
    reqs = [_req("a", [1], [], logit_bias={**bias, 31: 1e9}), _req("b", [1], [], temperature=0)]
    logits = _logits(2, seed=2)
    out = _processed(SamplingState(CPU), reqs, logits)
    reference = SequenceBiasLogitsProcessor(
        {(3,): 5.0, (17,): -2.5, (30,): 100.0, (31,): 100.0}  # 1e9 clamps to 100
    )(torch.tensor([[1]]), logits[:1].clone())
    torch.testing.assert_close(out[:1], reference)
    direct = logits[0].clone()
    for token, value in {**bias, 31: 100.0}.items():
        direct[token] += value
    torch.testing.assert_close(out[0], direct)
    assert torch.equal(out[1], logits[1])


def test_bias_is_applied_before_the_repetition_penalty() -> None:
    """vLLM's order: the penalty scales the biased logit."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = -1.0
    reqs = [_req("a", [5], [], logit_bias={5: 3.0}, repetition_penalty=2.0)]
    out = _processed(SamplingState(CPU), reqs, logits)
    assert float(out[0, 5]) == pytest.approx((-1.0 + 3.0) / 2.0)


def test_allowed_token_ids_match_transformers_prefix_constraint() -> None:
    allowed = [2, 7, 19, 33]
    reqs = [
        _req("x", [1], [], temperature=0),
        _req("a", [1], [4], allowed_token_ids=allowed, temperature=0),
    ]
    logits = _logits(2, seed=3)
    out = _processed(SamplingState(CPU), reqs, logits)
    reference = PrefixConstrainedLogitsProcessor(lambda _batch, _ids: allowed, num_beams=1)(
        torch.tensor([[1, 4]]), logits[1:].clone()
    )
    assert torch.equal(out[1:], reference)
    assert set(torch.nonzero(out[1].isfinite()).flatten().tolist()) == set(allowed)
    assert torch.equal(out[0], logits[0])
    tokens = Sampler(0, CPU).sample(logits, SamplingState(CPU).build(reqs, VOCAB)).token_ids
    assert int(tokens[1]) == max(allowed, key=lambda t: float(logits[1, t]))  # greedy too


def _reference_bad_words(words: list[list[int]], output: list[int], row: torch.Tensor):
    processor = NoBadWordsLogitsProcessor(words, eos_token_id=EOS)
    return processor(torch.tensor([output or [EOS]]), row[None].clone())[0]


@pytest.mark.parametrize(
    "output",
    [[], [1], [9, 2], [1, 2], [5, 1, 2], [1, 2, 3], [7, 8], [3, 7, 8], [0, 7, 8, 9], [8]],
)
def test_bad_words_match_a_direct_computation_and_transformers(output: list[int]) -> None:
    words = [[4], [1, 2, 3], [2, 6], [7, 8, 9, 10], [11, 8]]
    reqs = [
        _req("a", [1, 2], output, bad_words=["w"], bad_words_token_ids=words),
        _req("b", [1, 2], output),
    ]
    logits = _logits(2, seed=4)
    out = _processed(SamplingState(CPU), reqs, logits)
    banned = {
        word[-1]
        for word in words
        if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1 :] == word[:-1]
    }
    assert set(torch.nonzero(out[0].isinf()).flatten().tolist()) == banned
    assert 4 in banned  # a one-token word is always banned
    if output:  # transformers reads input_ids; give it the output only, as vLLM matches
        assert torch.equal(out[0], _reference_bad_words(words, output, logits[0]))
    assert torch.equal(out[1], logits[1])


def test_bad_word_prefix_must_lie_in_the_output_not_the_prompt() -> None:
    patterns = [BadWordPatterns.build([[1, 2, 3]]), BadWordPatterns.build([[1, 2, 3], [5]])]
    owners, tokens = bad_word_bans(patterns, [[2], [1, 2]])
    assert list(zip(owners.tolist(), tokens.tolist(), strict=True)) == [(1, 3), (1, 5)]
    reqs = [_req("a", [1, 2], [], bad_words=["w"], bad_words_token_ids=[[1, 2, 3]])]
    assert torch.equal(_processed(SamplingState(CPU), reqs, _logits(1)), _logits(1))


def test_min_tokens_wins_over_allowed_ids_bias_and_penalties() -> None:
    logits = _logits(1, seed=5)
    params = {
        "min_tokens": 3,
        "stop_token_ids": [7],
        "allowed_token_ids": [7, EOS, 1],
        "logit_bias": {EOS: 100.0, 7: 50.0},
        "frequency_penalty": -2.0,
        "temperature": 0,
        "max_tokens": 9,
    }
    state = SamplingState(CPU, eos_token_ids=[EOS])
    early = _processed(state, [_req("a", [2], [EOS, 7], **params)], logits)
    assert set(torch.nonzero(early[0].isfinite()).flatten().tolist()) == {1}
    late = _processed(state, [_req("b", [2], [EOS, 7, 1], **params)], logits)
    assert int(late[0].argmax()) == EOS


def test_output_counts_grow_incrementally_and_survive_row_reuse() -> None:
    state = SamplingState(CPU)
    reqs = [_req(f"r{i}", [i, i + 1], [], frequency_penalty=1.0) for i in range(6)]
    generator = torch.Generator().manual_seed(6)
    for _step in range(5):
        tensors = state.build(reqs, VOCAB)
        assert tensors.adjustments is not None
        assert tensors.adjustments.penalties is not None
        counts = tensors.adjustments.penalties.output_counts
        for row, req in enumerate(reqs):
            output = torch.tensor(req.token_ids[2:], dtype=torch.int64)
            assert torch.equal(counts[row], torch.bincount(output, minlength=VOCAB).int())
            assert (
                torch.nonzero(tensors.adjustments.penalties.prompt_mask[row]).flatten().tolist()
                == req.prompt_token_ids
            )
        for req in reqs:
            req.token_ids.append(int(torch.randint(0, 5, (1,), generator=generator)))
    assert state.counts.output_counts.shape == (8, VOCAB)  # grew 4 -> 8
    # Finished and resumed requests give their rows back; a newcomer starts from zero.
    reset = SchedulerOutput([], [CachedRequestData("r1", 0, [3], None, is_resumed=True)], {}, 0,
                            (), frozenset({"r0"}))  # fmt: skip
    state.update(reset)
    reqs[1].token_ids = [*reqs[1].prompt_token_ids, 3]
    newcomer = _req("new", [9], [9, 9], frequency_penalty=1.0)
    tensors = state.build([newcomer, reqs[1]], VOCAB)
    assert tensors.adjustments is not None
    assert tensors.adjustments.penalties is not None
    counts = tensors.adjustments.penalties.output_counts
    assert counts[0].tolist() == torch.bincount(torch.tensor([9, 9]), minlength=VOCAB).tolist()
    assert counts[1].tolist() == torch.bincount(torch.tensor([3]), minlength=VOCAB).tolist()
    assert state.counts.output_counts.shape == (8, VOCAB)  # rows reused, no growth


def test_requests_without_edits_stay_on_the_fast_path() -> None:
    reqs = [_req("a", [1], [2], temperature=0), _req("b", [1], [], top_k=3, min_tokens=0)]
    tensors = SamplingState(CPU, eos_token_ids=[EOS]).build(reqs, VOCAB)
    assert tensors.banned is None
    assert tensors.adjustments is None
    logits = _logits(2)
    assert process_logits(logits, tensors.banned, tensors.adjustments) is logits


def test_greedy_rows_draw_from_the_penalised_logits() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    reqs = [
        _req("a", [1], [3], temperature=0, repetition_penalty=2.0),
        _req("b", [1], [3], temperature=0),
    ]
    out = Sampler(0, CPU).sample(logits, SamplingState(CPU).build(reqs, VOCAB))
    assert out.token_ids.tolist() == [4, 3]


def test_untokenized_bad_words_and_out_of_vocabulary_ids_are_refused() -> None:
    with pytest.raises(RuntimeError, match="with_bad_words_token_ids"):
        SamplingState(CPU).build([_req("a", [1], [], bad_words=["x"])], VOCAB)
    with pytest.raises(ValueError, match="allowed_token_ids has token ids outside"):
        SamplingState(CPU).build([_req("a", [1], [], allowed_token_ids=[VOCAB])], VOCAB)

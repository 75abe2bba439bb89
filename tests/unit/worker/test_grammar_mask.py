"""The structured-outputs bitmask on the logits: xgrammar's kernel and the torch fallback agree
with a bit-by-bit reading of the packed words, and only the constrained sampling rows change."""

from __future__ import annotations

import pytest
import torch

from scheduler.output import GrammarBitmask
from worker import grammar_mask
from worker.grammar_mask import GrammarMask, apply_grammar_mask, unpack_bitmask

VOCAB = 70  # three words, the last one partly past the vocabulary


def packed(allowed: list[set[int]]) -> torch.Tensor:
    words = torch.zeros((len(allowed), 3), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


ALLOWED = [{0, 31, 32, 63, 69}, {5}, set(range(VOCAB))]


def test_unpacking_reads_each_bit() -> None:
    unpacked = unpack_bitmask(packed(ALLOWED), VOCAB)
    for row, tokens in enumerate(ALLOWED):
        assert set(torch.nonzero(unpacked[row]).flatten().tolist()) == tokens


@pytest.mark.parametrize("use_xgrammar", [True, False])
def test_only_constrained_rows_are_masked(
    monkeypatch: pytest.MonkeyPatch, use_xgrammar: bool
) -> None:
    monkeypatch.setattr(grammar_mask, "_HAS_XGRAMMAR", use_xgrammar)
    words = packed(ALLOWED[:2])
    message = GrammarBitmask(("b", "d"), 3, words.numpy().tobytes())
    mask = GrammarMask.build(message, ["a", "b", "c", "d"], torch.device("cpu"))
    assert mask is not None
    assert not mask.covers_all
    logits = torch.randn(4, VOCAB)
    out = apply_grammar_mask(logits, mask)
    assert torch.equal(out[0], logits[0])
    assert torch.equal(out[2], logits[2])
    for row, tokens in ((1, ALLOWED[0]), (3, ALLOWED[1])):
        finite = set(torch.nonzero(torch.isfinite(out[row])).flatten().tolist())
        assert finite == tokens
    assert torch.isfinite(logits).all()  # the raw logits stay (logprobs are theirs)


def test_rows_of_requests_that_do_not_sample_are_skipped() -> None:
    message = GrammarBitmask(("x",), 3, packed(ALLOWED[:1]).numpy().tobytes())
    assert GrammarMask.build(message, ["a"], torch.device("cpu")) is None
    assert GrammarMask.build(None, ["a"], torch.device("cpu")) is None

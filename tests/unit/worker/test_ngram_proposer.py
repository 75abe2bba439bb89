"""N-gram (prompt lookup) drafts: the longest matching tail wins, its latest earlier occurrence
is continued, and nothing is proposed without a match."""

from __future__ import annotations

from worker.spec_decode.ngram import propose_ngram
from worker.spec_decode.proposer import DraftRequest, NgramProposer


def test_continues_the_latest_occurrence_of_the_longest_tail() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # tail [2, 3] occurs at 1 and 5 (latest: followed by 7, 8); [5, 2, 3] nowhere else
    assert propose_ngram(tokens, 1, 3, 3) == [7, 8, 5]
    assert propose_ngram(tokens, 1, 3, 1) == [7]


def test_longer_match_beats_a_later_shorter_one() -> None:
    tokens = [4, 5, 6, 1, 9, 6, 2, 4, 5, 6]
    assert propose_ngram(tokens, 1, 3, 2) == [1, 9]  # [4, 5, 6] beats the later [6]
    assert propose_ngram(tokens, 1, 1, 2) == [2, 4]  # tails of one token: the later 6


def test_no_match_no_drafts() -> None:
    assert propose_ngram([1, 2, 3, 4], 1, 3, 4) == []
    assert propose_ngram([1, 1], 2, 3, 4) == []
    assert propose_ngram([1, 2, 1], 1, 2, 0) == []


def test_proposer_drafts_only_requests_with_a_match() -> None:
    proposer = NgramProposer(2, 1, 4)
    drafts = proposer.propose([DraftRequest("a", [1, 2, 3, 1, 2]), DraftRequest("b", [1, 2])])
    assert drafts == {"a": [3, 1]}

"""Tokenize `SamplingParams.bad_words` into the token sequences the sampler bans.

The engine (which holds the tokenizer) calls `attach_bad_words_token_ids` before sending a
request. Each word is tokenized as written (leading spaces stripped) and with one leading space,
since a word inside a sentence is usually a different token than at the start; duplicates and
empty results are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scheduler.request import SamplingParams


class Encoder(Protocol):
    """The part of a Hugging Face tokenizer used here."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def tokenize_bad_words(tokenizer: Encoder, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Token-id sequences of `words`, without and with a leading space, each once."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for prefix in ("", " "):
            ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
            if ids:
                sequences[ids] = None
    return tuple(sequences)


def attach_bad_words_token_ids(params: SamplingParams, tokenizer: Encoder) -> SamplingParams:
    """`params` with `bad_words_token_ids` set (unchanged when it has no bad words)."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    return params.with_bad_words_token_ids(tokenize_bad_words(tokenizer, params.bad_words))

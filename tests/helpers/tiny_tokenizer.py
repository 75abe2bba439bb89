"""A tiny word-level tokenizer for the tiny test models, built offline (no downloads)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast


def save_word_tokenizer(path: Path, vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over the words t0..t{n-1}, saved into `path`."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    tokenizer.save_pretrained(path)
    return tokenizer

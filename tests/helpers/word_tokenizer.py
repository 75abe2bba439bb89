"""A word-level tokenizer over the words t0..t{n-1} with a small chat template, built offline.

Saved next to a tiny model, it lets tests send text prompts and chat messages to the engine.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ 't1 ' + message['content'] + ' ' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 't2' }}{% endif %}"
)
"""Each message is `t1 <content>`; the generation prompt is `t2`."""


def save_word_tokenizer(
    path: Path, vocab_size: int, chat_template: str = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """Save the tokenizer (with `chat_template`) to `path`; return it."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer

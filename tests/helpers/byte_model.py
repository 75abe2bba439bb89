"""A tiny random llama over a byte-level tokenizer (one token per byte, no merges), built offline.

Every string is reachable token by token, so grammars (JSON, regex, tool calls) can be followed
to the end by a random model; the vocabulary is small, so grammars compile in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.helpers.tiny_models import save_tiny_model

EOS = "<|end|>"
EOS_ID = 256
VOCAB_SIZE = 264
"""256 bytes, the end token and padding rows (a model's vocabulary may exceed its tokenizer's)."""
CHAT_TEMPLATE = (
    "{% if tools %}{{ 'tools: ' + (tools | tojson) + '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + (m['content'] or '') + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are shifted
    past 255 (so the ByteLevel pre-tokenizer and decoder map them back)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in chars)
    for offset, byte in enumerate(shifted):
        chars[byte] = chr(256 + offset)
    return chars


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {char: byte for byte, char in byte_chars().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(EOS, special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_byte_model(path: Path, seed: int = 0) -> Path:
    """A tiny llama (vocabulary `VOCAB_SIZE`, EOS `EOS_ID`) and its byte tokenizer in `path`."""
    save_tiny_model(
        "llama",
        path,
        seed=seed,
        vocab_size=VOCAB_SIZE,
        eos_token_id=EOS_ID,
        max_position_embeddings=1024,
    )
    byte_tokenizer().save_pretrained(path)
    return path

"""Incremental detokenization against the whole-sequence decode, and stop strings.

Oracle: `tokenizer.decode(ids[:k])` for every prefix k. The text streamed so far must always be
a prefix of it, and equal to it whenever it does not end mid-character; the final text must
equal the decode of the whole output. Two tokenizers: the embedded default model's byte-level
BPE, and a SentencePiece-style BPE with byte fallback built here (no download).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cluster.engine.detokenizer import IncrementalDetokenizer
from scheduler.request import SamplingParams

TEXTS = [
    "The capital of France is Paris. Élan vital, naïve café — déjà vu!",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Emoji: 👩‍👩‍👧‍👦 🇫🇷 🎉🎉 ✓ and a cat 🐈‍⬛.",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # ∑ λ → ∞\n\tprint(f(3))",
    "Привет, мир! Γειά σου κόσμε! مرحبا بالعالم! שלום עולם",
]


def _byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-like BPE (metaspace, byte fallback): unseen characters become
    <0xNN> byte tokens, as in Llama's tokenizer."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *byte_tokens]
    )
    backend.train_from_iterator(["hello world the cat sat on the mat paris france"] * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.fixture(scope="module", params=["byte-level-bpe", "byte-fallback"])
def tokenizer(request: pytest.FixtureRequest, default_model_dir: Path):
    if request.param == "byte-fallback":
        return _byte_fallback_tokenizer()
    return AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_matches_the_full_decode_at_every_prefix(tokenizer, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    streamed = ""
    for k in range(1, len(ids) + 1):
        streamed += detokenizer.update([ids[k - 1]])
        full = tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert full.startswith(streamed)
        if not full.endswith("\ufffd"):
            assert streamed == full
    streamed += detokenizer.finish()
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
    assert detokenizer.output_text == streamed


def test_several_tokens_at_once_give_the_same_text(tokenizer) -> None:
    ids = tokenizer(TEXTS[2], add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    streamed = "".join(detokenizer.update(ids[k : k + 3]) for k in range(0, len(ids), 3))
    assert streamed + detokenizer.finish() == tokenizer.decode(ids, skip_special_tokens=True)


def _run(tokenizer, text: str, **params: object) -> tuple[str, str, IncrementalDetokenizer]:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))  # type: ignore[arg-type]
    streamed = ""
    for token in ids:
        streamed += detokenizer.update([token])
        if detokenizer.finished_by_stop_string:
            break
    return streamed + detokenizer.finish(), tokenizer.decode(ids), detokenizer


def test_a_stop_string_across_token_boundaries_cuts_the_text_exactly(tokenizer) -> None:
    text = "hello world the cat sat on the mat"
    streamed, _, detokenizer = _run(tokenizer, text, stop=["cat sat"])
    assert streamed == "hello world the "
    assert detokenizer.stop_reason == "cat sat"
    kept, _, _ = _run(tokenizer, text, stop="cat sat", include_stop_str_in_output=True)
    assert kept == "hello world the cat sat"


def test_the_earliest_of_several_stop_strings_wins_and_none_leaks(tokenizer) -> None:
    text = "hello world the cat sat on the mat"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["mat", "the c"]))
    pieces = [detokenizer.update([token]) for token in ids]
    assert "".join(pieces) == "hello world "  # the held-back "the" never reached the stream
    assert detokenizer.stop_reason == "the c"


def test_a_stop_string_at_the_very_start_gives_empty_text(tokenizer) -> None:
    streamed, _, detokenizer = _run(tokenizer, "hello world", stop=["hel"])
    assert streamed == ""
    assert detokenizer.stop_reason == "hel"


def test_min_tokens_keeps_an_early_stop_string_from_ending_the_sequence(tokenizer) -> None:
    text = "hello world hello world"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    first = len(tokenizer("hello world", add_special_tokens=False).input_ids)
    streamed, _, detokenizer = _run(tokenizer, text, stop=["world"], min_tokens=first + 1)
    assert detokenizer.stop_reason == "world"
    assert streamed.startswith("hello world")
    assert len(ids) > first

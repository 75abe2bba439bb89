"""Incremental detokenization against the tokenizer's own full decode, and stop strings.

Two tokenizers: the embedded default model's (GPT-2-style byte-level BPE) and a SentencePiece-
style BPE with byte fallback trained here (Metaspace, `<0xNN>` tokens, Llama's decoder).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cluster.engine.bad_words import attach_bad_words_token_ids, tokenize_bad_words
from cluster.engine.detokenizer import BYTE_TOKEN, IncrementalDetokenizer
from cluster.engine.stop_strings import find_stop, partial_stop_len
from scheduler.request import SamplingParams
from worker.default_model import default_gguf_path

TEXTS = [
    "Hello, world! How are you today?",
    "Größe, naïve café — “quotes” and ‘apostrophes’ à la française.",
    "日本語のテキストと中文字符，还有한국어 문장。",
    "Привет, мир! Ελληνικά γράμματα. مرحبا بالعالم. हिन्दी पाठ",
    "emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷 heart ❤️ and 🤖!",
    'def f(x):\n    return {"k": x**2}  # comment\n\tif a != b: pass\n',
    "  leading spaces,\n\nblank lines, trailing  ",
]
PROMPT = "Prompt: "


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """The embedded default model's tokenizer, read from its GGUF file as the conversion behind
    `default_model_dir` reads it (seconds, where converting the whole model takes minutes)."""
    gguf = default_gguf_path()
    return AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )


@pytest.mark.slow
def test_converted_default_model_has_the_same_tokenizer(default_model_dir: Path, byte_level):
    converted = AutoTokenizer.from_pretrained(str(default_model_dir), local_files_only=True)
    for text in TEXTS:
        ids = byte_level.encode(text, add_special_tokens=False)
        assert converted.encode(text, add_special_tokens=False) == ids
        assert converted.decode(ids) == byte_level.decode(ids)


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style tokenizer: most characters exist only as `<0xNN>` bytes."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    corpus = ["Hello world, how are you? def f(x): return x + 1", "The quick brown fox."] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=40
    )
    tokenizer.train_from_iterator(corpus, trainer)
    spec = json.loads(tokenizer.to_str())
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


@pytest.fixture(params=["byte_level", "byte_fallback"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return request.getfixturevalue(request.param)


def _expected(tokenizer, prompt: list[int], ids: list[int], params: SamplingParams) -> str:
    """The output's text as the full decode gives it (in the context of the prompt)."""
    kwargs = {
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
    }
    head = tokenizer.decode(prompt, **kwargs)
    full = tokenizer.decode(prompt + ids, **kwargs)
    assert full.startswith(head)
    return full[len(head) :]


def _check_every_prefix(tokenizer, prompt: list[int], ids: list[int], params: SamplingParams):
    """Streaming: text so far is a prefix of the full decode and equals it unless the decode ends
    in an incomplete character or a byte-fallback run; finished at any prefix: equal to it."""
    detok = IncrementalDetokenizer(tokenizer, prompt, params)
    deltas = []
    for count in range(1, len(ids) + 1):
        deltas.append(detok.update([ids[count - 1]]))
        expected = _expected(tokenizer, prompt, ids[:count], params)
        assert detok.output_text == "".join(deltas)
        assert expected.startswith(detok.output_text), (count, expected, detok.output_text)
        last_is_byte = BYTE_TOKEN.fullmatch(tokenizer.convert_ids_to_tokens(ids[count - 1]))
        if not expected.endswith("\ufffd") and not last_is_byte:
            assert detok.output_text == expected  # nothing held back without a reason
        final = IncrementalDetokenizer(tokenizer, prompt, params)
        for token in ids[: count - 1]:
            final.update([token])
        final.update([ids[count - 1]], final=True)
        assert final.output_text == expected


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_incremental_text_equals_the_full_decode_at_every_prefix(tokenizer, text: str) -> None:
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    _check_every_prefix(tokenizer, prompt, ids, SamplingParams())
    _check_every_prefix(tokenizer, [], ids, SamplingParams())


@pytest.mark.parametrize("seed", range(3))
def test_random_token_sequences_split_inside_characters(tokenizer, seed: int) -> None:
    """Arbitrary ids: bytes that form characters only together, or never."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) for _ in range(40)]
    _check_every_prefix(tokenizer, [], ids, SamplingParams())


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_the_decode_flags(tokenizer, skip: bool) -> None:
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("one two", add_special_tokens=False), eos, eos]
    ids += tokenizer.encode(" three 😀", add_special_tokens=False)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        _check_every_prefix(tokenizer, prompt, ids, params)


def _stream(tokenizer, text: str, **params) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))
    deltas = [detok.update([token]) for token in tokenizer.encode(text, add_special_tokens=False)]
    return detok, deltas


def test_stop_string_across_token_boundaries_cuts_the_text_exactly(byte_level) -> None:
    text = "The answer is forty-two. Done here"
    ids = byte_level.encode(text, add_special_tokens=False)
    stop = "swer is fo"
    assert all(stop not in byte_level.decode([t]) for t in ids)  # spans several tokens
    detok, deltas = _stream(byte_level, text, stop=[stop])
    assert detok.finished_by_stop_string
    assert detok.stop_reason == stop
    assert detok.output_text == "".join(deltas) == "The an"
    assert detok.update(byte_level.encode(" more", add_special_tokens=False)) == ""
    assert detok.output_text == "The an"


def test_include_stop_str_in_output_keeps_the_stop_string(byte_fallback) -> None:
    detok, deltas = _stream(
        byte_fallback, "quick brown fox jumps", stop="brown f", include_stop_str_in_output=True
    )
    assert detok.stop_reason == "brown f"
    assert "".join(deltas) == detok.output_text == "quick brown f"


def test_the_earliest_of_several_stop_strings_wins(tokenizer) -> None:
    detok, deltas = _stream(tokenizer, "alpha beta gamma delta", stop=["delta", "eta g", "gam"])
    assert detok.stop_reason == "eta g"
    assert "".join(deltas) == "alpha b"


def test_stop_string_at_the_very_start_gives_empty_text(tokenizer) -> None:
    detok, deltas = _stream(tokenizer, "Hello world", stop=["Hel", "zzz"])
    assert detok.stop_reason == "Hel"
    assert detok.output_text == "".join(deltas) == ""


def test_possible_stop_prefix_is_held_back_until_it_cannot_match(byte_level) -> None:
    detok = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["###"]))
    emitted = ""
    for token in byte_level.encode("a ## b ### c", add_special_tokens=False):
        emitted += detok.update([token])
        assert not emitted.endswith("#")  # a tail that may become "###" waits
    assert detok.stop_reason == "###"
    assert emitted == detok.output_text == "a ## b "
    unfinished = IncrementalDetokenizer(byte_level, [], SamplingParams(stop=["###"]))
    text = "".join(
        unfinished.update([t]) for t in byte_level.encode("x ##", add_special_tokens=False)
    )
    assert text == "x "
    assert unfinished.update([], final=True) == "##"  # the request ended otherwise: release it
    assert unfinished.output_text == "x ##"
    assert not unfinished.finished_by_stop_string


def test_min_tokens_keeps_an_early_stop_string_from_ending_the_request(byte_level) -> None:
    text = "stop here, then stop again"
    ids = byte_level.encode(text, add_special_tokens=False)
    early = len(byte_level.encode("stop", add_special_tokens=False))
    detok, deltas = _stream(byte_level, text, stop=["stop"], min_tokens=early + 1, max_tokens=50)
    assert detok.stop_reason == "stop"
    assert "".join(deltas) == "stop here, then "
    assert detok.num_output_tokens < len(ids)


def test_stop_string_helpers() -> None:
    assert find_stop("abcabc", ["bc"], new_from=4).start == 4
    assert find_stop("abcabc", ["bc"], new_from=0).start == 1
    assert find_stop("abcd", ["cd", "bcd"], new_from=3).stop == "bcd"
    assert find_stop("abc", ["x"], new_from=0) is None
    assert partial_stop_len("hello wo", ["world", "low"]) == 2
    assert partial_stop_len("hello", ["world"]) == 0
    assert partial_stop_len("ab", ["abc"]) == 2


def test_bad_words_are_tokenized_with_and_without_a_leading_space(byte_level) -> None:
    sequences = tokenize_bad_words(byte_level, ["hello", " world peace"])
    texts = {byte_level.decode(list(ids)) for ids in sequences}
    assert texts == {"hello", " hello", "world peace", " world peace"}
    params = attach_bad_words_token_ids(SamplingParams(bad_words=["hello"]), byte_level)
    assert params.bad_words_token_ids == tokenize_bad_words(byte_level, ["hello"])
    plain = SamplingParams()
    assert attach_bad_words_token_ids(plain, byte_level) is plain

"""SamplingParams validation and Request bookkeeping (tokens, block hashes, status)."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from scheduler.block_hash import hash_block_tokens
from scheduler.request import Request, RequestStatus, SamplingParams


def test_default_sampling_params_are_valid_and_frozen() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0 and finite"),
        ({"temperature": float("nan")}, "temperature must be >= 0 and finite"),
        ({"temperature": float("inf")}, "temperature must be >= 0 and finite"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"top_k": -2}, "top_k must be -1"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be in \[0, max_tokens=4\]"),
        ({"min_tokens": -1}, "min_tokens must be in"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\]"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\]"),
        ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\]"),
        ({"stop_token_ids": (3, -1)}, "stop_token_ids must be non-negative ints"),
        ({"stop_token_ids": 3}, "stop_token_ids must be a list of token ids"),
        ({"n": 0}, "n must be >= 1"),
        ({"n": 1.0}, "n must be an int"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": "x"}, "frequency_penalty must be a number"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be non-negative token ids"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias keys must be non-negative token ids"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias values must be numbers"),
        ({"logit_bias": {1: "big"}}, "logit_bias values must be numbers"),
        ({"logit_bias": 5}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids must be non-negative ints"),
        ({"bad_words": "word"}, "bad_words must be a list of strings"),
        ({"bad_words": ["ok", ""]}, "bad_words must not contain an empty string"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids must not hold an empty"),
        ({"stop": ["a", ""]}, "stop must not contain an empty string"),
        ({"stop": ["a", 3]}, "stop must hold strings"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a bool"),
        ({"spaces_between_special_tokens": "no"}, "spaces_between_special_tokens must be a bool"),
        ({"stop_token_ids": (3.0,)}, "stop_token_ids must be non-negative ints"),
        ({"seed": 2**64}, "seed must be in"),
        ({"seed": -(2**63) - 1}, "seed must be in"),
        ({"seed": 1.5}, "seed must be an int or None"),
        ({"ignore_eos": 1}, "ignore_eos must be a bool"),
        ({"max_tokens": 2.0}, "max_tokens must be an int"),
        ({"top_k": True}, "top_k must be an int"),
        ({"temperature": "hot"}, "temperature must be a number"),
    ],
)
def test_invalid_sampling_params_raise_value_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0, "top_p": 1, "top_k": 1, "min_p": 1.0},
        {"max_tokens": 1, "min_tokens": 1, "logprobs": 0, "prompt_logprobs": 20},
        {"stop_token_ids": (0, 7), "seed": 2**64 - 1, "ignore_eos": True},
        {"seed": -(2**63)},
        {"n": 4, "presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 1e-3},
        {"logit_bias": {0: -100, 5: 100}, "allowed_token_ids": [0], "bad_words": []},
    ],
)
def test_boundary_sampling_params_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_lists_are_accepted_and_stored_as_tuples() -> None:
    params = SamplingParams(
        stop_token_ids=[2],
        stop="###",
        allowed_token_ids=[5, 3],
        bad_words=["foo", "bar baz"],
        bad_words_token_ids=[[7], [8, 9]],
    )
    assert params.stop_token_ids == (2,)
    assert params.stop == ("###",)
    assert params.allowed_token_ids == (5, 3)
    assert params.bad_words == ("foo", "bar baz")
    assert params.bad_words_token_ids == ((7,), (8, 9))
    assert SamplingParams(stop=["a", "b"], stop_token_ids=None).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[2]) == SamplingParams(stop_token_ids=(2,))


def test_vllm_defaults() -> None:
    params = SamplingParams()
    assert (params.n, params.presence_penalty, params.frequency_penalty) == (1, 0.0, 0.0)
    assert params.repetition_penalty == 1.0
    assert params.logit_bias == ()
    assert params.allowed_token_ids is None
    assert params.bad_words == ()
    assert params.bad_words_token_ids is None
    assert params.stop == ()
    assert not params.include_stop_str_in_output
    assert params.skip_special_tokens
    assert params.spaces_between_special_tokens
    assert not params.uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties


def test_init_defaults_match_field_defaults() -> None:
    """The hand-written __init__ and the field declarations must not drift apart."""
    signature = inspect.signature(SamplingParams.__init__)
    for spec in dataclasses.fields(SamplingParams):
        default = signature.parameters[spec.name].default
        if default is None and spec.default == ():  # None stands for "no entries"
            continue
        assert default == spec.default, spec.name
    assert set(signature.parameters) - {"self"} == {
        f.name for f in dataclasses.fields(SamplingParams)
    }


def test_logit_bias_is_clamped_sorted_and_accepts_string_keys() -> None:
    params = SamplingParams(logit_bias={9: 250.0, "3": -1000, 4: 0.5})
    assert params.logit_bias == ((3, -100.0), (4, 0.5), (9, 100.0))
    assert dict(params.logit_bias) == {3: -100.0, 4: 0.5, 9: 100.0}
    assert SamplingParams(logit_bias=params.logit_bias) == params  # pairs round-trip


def test_params_stay_immutable_hashable_and_replaceable() -> None:
    params = SamplingParams(stop=["x"], logit_bias={1: 2.0}, allowed_token_ids=[1, 2], n=2)
    assert hash(params) == hash(
        SamplingParams(stop="x", logit_bias={1: 2}, allowed_token_ids=(1, 2), n=2)
    )
    assert pickle.loads(pickle.dumps(params)) == params
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.stop = ()  # type: ignore[misc]
    changed = dataclasses.replace(params, stop_token_ids=[4, 5])
    assert changed.stop_token_ids == (4, 5)
    assert changed.logit_bias == params.logit_bias
    with pytest.raises(ValueError, match="n must be >= 1"):
        dataclasses.replace(params, n=0)


def test_with_bad_words_token_ids_attaches_a_normalised_copy() -> None:
    params = SamplingParams(bad_words=["foo"])
    tokenized = params.with_bad_words_token_ids([[4], [1, 4]])
    assert tokenized.bad_words_token_ids == ((4,), (1, 4))
    assert params.bad_words_token_ids is None
    assert tokenized.bad_words == ("foo",)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        params.with_bad_words_token_ids([[-1]])


def test_verify_token_ids_names_the_field_outside_the_vocabulary() -> None:
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9]).verify_token_ids(10)
    with pytest.raises(ValueError, match="logit_bias has token ids outside"):
        SamplingParams(logit_bias={10: 1.0}).verify_token_ids(10)
    with pytest.raises(ValueError, match="allowed_token_ids has token ids outside"):
        SamplingParams(allowed_token_ids=[3, 12]).verify_token_ids(10)
    with pytest.raises(ValueError, match="bad_words_token_ids has token ids outside"):
        SamplingParams(bad_words_token_ids=[[3, 12]]).verify_token_ids(10)


def _chain(tokens: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    hashes: list[bytes] = []
    for index in range(len(tokens) // block_size):
        extra = (salt,) if salt is not None and index == 0 else None
        block = tokens[index * block_size : (index + 1) * block_size]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block, extra))
    return hashes


def test_block_hashes_follow_appended_tokens() -> None:
    prompt = list(range(10))
    request = Request("r", prompt, SamplingParams(), hash_block_size=4)
    assert request.num_tokens == 10
    assert request.num_prompt_tokens == 10
    assert request.block_hashes == _chain(prompt, 4)
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([10])
    assert len(request.block_hashes) == 2  # block 2 not full yet
    request.append_output_token_ids([11, 12, 13])
    assert request.output_token_ids == [10, 11, 12, 13]
    assert request.all_token_ids == list(range(14))
    assert request.num_output_tokens == 4
    assert request.block_hashes == _chain(list(range(14)), 4)
    assert len(request.block_hashes) == 3


def test_cache_salt_changes_every_block_hash() -> None:
    plain = Request("a", list(range(8)), SamplingParams(), hash_block_size=4)
    salted = Request("b", list(range(8)), SamplingParams(), hash_block_size=4, cache_salt="s")
    assert salted.block_hashes == _chain(list(range(8)), 4, "s")
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes, strict=True))


def test_request_defaults_and_rejections() -> None:
    request = Request("r", [1], SamplingParams(), hash_block_size=16, priority=3)
    assert request.status is RequestStatus.WAITING
    assert request.num_computed_tokens == 0
    assert request.num_cached_tokens is None
    assert request.priority == 3
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r", [], SamplingParams(), hash_block_size=16)
    with pytest.raises(ValueError, match="hash_block_size"):
        Request("r", [1], SamplingParams(), hash_block_size=0)


def test_request_built_with_outputs_keeps_them_in_all_tokens() -> None:
    request = Request("r", [1, 2], SamplingParams(), hash_block_size=2, output_token_ids=[3, 4])
    assert request.all_token_ids == [1, 2, 3, 4]
    assert request.block_hashes == _chain([1, 2, 3, 4], 2)


def test_finished_statuses() -> None:
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
    }

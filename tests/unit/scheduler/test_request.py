"""SamplingParams validation and Request bookkeeping (tokens, block hashes, status)."""

from __future__ import annotations

import dataclasses

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
        ({"stop_token_ids": 3}, "stop_token_ids must be a list of ints"),
        ({"stop": ["ok", ""]}, "stop must be non-empty strings"),
        ({"stop": 5}, "stop must be non-empty strings"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
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
    ],
)
def test_boundary_sampling_params_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


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


def test_vllm_list_spellings_are_accepted_and_stored_as_tuples() -> None:
    params = SamplingParams(stop_token_ids=[2, 3], stop="END")
    assert params.stop_token_ids == (2, 3)
    assert params.stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    hash(params)

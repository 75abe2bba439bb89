"""Validation and normalisation helpers of `SamplingParams`.

Each helper raises ValueError naming the field (never TypeError), so callers map every invalid
parameter to one error; sequences come back as tuples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

MAX_LOGPROBS = 20
MIN_TEMPERATURE = 1e-5
"""Lower temperatures sample greedily: dividing by them would overflow fp32 logits to inf."""
SEED_MIN = -(2**63)
"""Seeds span what a 64-bit generator accepts: signed or unsigned 64-bit values."""
SEED_MAX = 2**64 - 1
MAX_LOGIT_BIAS = 100.0
"""Biases are clamped to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range, as vLLM does)."""

_NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("n", "top_k", "max_tokens", "min_tokens")
_OPTIONAL_INT_FIELDS = ("logprobs", "prompt_logprobs", "seed")
_BOOL_FIELDS = (
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)


def check(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless `condition` holds."""
    if not condition:
        raise ValueError(message)


def is_int(value: object) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_types(params: object) -> None:
    """Reject wrongly typed scalar fields before the range checks compare them."""
    for name in _NUMBER_FIELDS:
        value = getattr(params, name)
        check(is_number(value), f"{name} must be a number, got {value!r}")
    for name in _INT_FIELDS:
        value = getattr(params, name)
        check(is_int(value), f"{name} must be an int, got {value!r}")
    for name in _OPTIONAL_INT_FIELDS:
        value = getattr(params, name)
        check(value is None or is_int(value), f"{name} must be an int or None, got {value!r}")
    for name in _BOOL_FIELDS:
        value = getattr(params, name)
        check(isinstance(value, bool), f"{name} must be a bool, got {value!r}")


def _is_sequence(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def token_id_tuple(name: str, value: object) -> tuple[int, ...]:
    """A list or tuple of non-negative token ids, as a tuple."""
    check(_is_sequence(value), f"{name} must be a list of token ids, got {value!r}")
    assert isinstance(value, Sequence)
    check(
        all(is_int(token) and token >= 0 for token in value),
        f"{name} must be non-negative ints, got {value!r}",
    )
    return tuple(value)


def token_sequences(name: str, value: object) -> tuple[tuple[int, ...], ...]:
    """A list of non-empty token-id lists, as nested tuples."""
    check(_is_sequence(value), f"{name} must be a list of token-id lists, got {value!r}")
    assert isinstance(value, Sequence)
    result = tuple(token_id_tuple(name, ids) for ids in value)
    check(all(result), f"{name} must not hold an empty sequence, got {value!r}")
    return result


def str_tuple(name: str, value: object, allow_str: bool) -> tuple[str, ...]:
    """None, a list of non-empty strings (or one string when `allow_str`), as a tuple."""
    if value is None:
        return ()
    if allow_str and isinstance(value, str):
        value = [value]
    check(_is_sequence(value), f"{name} must be a list of strings, got {value!r}")
    assert isinstance(value, Sequence)
    check(all(isinstance(s, str) for s in value), f"{name} must hold strings, got {value!r}")
    check(all(value), f"{name} must not contain an empty string")
    return tuple(value)


def bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, clamped bias) pairs.

    Accepts a mapping (token ids as ints or, as in OpenAI's JSON, decimal strings) or pairs.
    """
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items: list[object] = list(value.items())
    else:
        check(_is_sequence(value), f"logit_bias must be a dict of token id -> bias, got {value!r}")
        assert isinstance(value, Sequence)
        items = list(value)
    biases: dict[int, float] = {}
    for item in items:
        check(
            _is_sequence(item) and len(item) == 2,  # type: ignore[arg-type]
            f"logit_bias entries must be (token id, bias) pairs, got {item!r}",
        )
        assert isinstance(item, Sequence)
        token_id = _bias_token(item[0])
        bias: object = item[1]
        check(
            isinstance(bias, (int, float)) and not isinstance(bias, bool) and not math.isnan(bias),
            f"logit_bias values must be numbers, got {bias!r} for token {item[0]!r}",
        )
        assert isinstance(bias, (int, float))
        biases[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
    return tuple(sorted(biases.items()))


def _bias_token(token: object) -> int:
    if isinstance(token, str) and token.isdecimal():
        token = int(token)
    check(
        is_int(token) and token >= 0,  # type: ignore[operator]
        f"logit_bias keys must be non-negative token ids, got {token!r}",
    )
    assert isinstance(token, int)
    return token

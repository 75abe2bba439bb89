"""The one validation of engine arguments (vLLM spelling) against `EngineArgs`.

`LLMConfig.engine_kwargs`, `LLM(**kwargs)` and the CLI all go through `validate_engine_kwargs`:
the dataclass's field names are the valid keys and its annotations the accepted types.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

from cluster.config.errors import unknown_key_message
from cluster.engine_args import EngineArgs

_TYPE_NAMES = {str: "str", int: "int", float: "float", bool: "bool", type(None): "None"}


@functools.cache
def engine_arg_types() -> dict[str, tuple[type, ...]]:
    """Each `EngineArgs` field name mapped to the Python types it accepts."""
    hints = typing.get_type_hints(EngineArgs)
    result = {}
    for field in dataclasses.fields(EngineArgs):
        hint = hints[field.name]
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        result[field.name] = tuple(typing.get_args(hint)) if is_union else (hint,)
    return result


def _accepts(value: object, allowed: tuple[type, ...]) -> bool:
    # bool is an int subclass: a flag never counts as a number, nor a number as a flag.
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return any(isinstance(value, kind) and kind is not bool for kind in allowed)


def _type_name(allowed: tuple[type, ...]) -> str:
    return " | ".join(_TYPE_NAMES.get(kind, kind.__name__) for kind in allowed)


def check_engine_kwargs(kwargs: Mapping[str, object]) -> None:
    """Raise a one-line ValueError for the first unknown key or wrongly typed value."""
    valid = engine_arg_types()
    for key, value in kwargs.items():
        if key not in valid:
            raise ValueError(unknown_key_message(key, valid, what="engine argument"))
        if not _accepts(value, valid[key]):
            raise ValueError(
                f"engine argument {key!r} must be {_type_name(valid[key])}, "
                f"got {type(value).__name__} {value!r}"
            )


def validate_engine_kwargs(kwargs: Mapping[str, object]) -> EngineArgs:
    """Check engine arguments by name and type, then build `EngineArgs` from them.

    Raises ValueError naming the key (and the closest valid one for a misspelling).
    """
    check_engine_kwargs(kwargs)
    return EngineArgs(**typing.cast("dict[str, Any]", dict(kwargs)))

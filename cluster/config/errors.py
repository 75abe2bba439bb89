"""Readable one-line error messages for configuration mistakes.

Used by every config model here, by `validate_engine_kwargs` and by `hybridserve config validate`.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

_VALUE_ERROR_PREFIX = "Value error, "
_SHOWS_INPUT = {"literal_error", "greater_than", "greater_than_equal", "less_than_equal"}


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The valid name most like `name`, or None when nothing is close."""
    matches = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def unknown_key_message(key: str, valid: Iterable[str], what: str = "key") -> str:
    """`unknown key 'x' (did you mean 'y'?)`, or the valid keys when none is close."""
    valid = sorted(valid)
    suggestion = closest(key, valid)
    hint = f"did you mean {suggestion!r}?" if suggestion else f"valid: {', '.join(valid)}"
    return f"unknown {what} {key!r} ({hint})"


def _location(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """Turn a pydantic error into one line: `where: what; where: what`."""
    return format_error_details(error.errors(include_url=False), prefix)


def format_error_details(items: Iterable[Mapping[str, Any]], prefix: str = "") -> str:
    """`format_validation_error` of a pydantic error's details (FastAPI hands a route's body
    errors over as these)."""
    parts = []
    for item in items:
        loc: tuple[int | str, ...] = ((prefix,) if prefix else ()) + tuple(item["loc"])
        message = item["msg"].removeprefix(_VALUE_ERROR_PREFIX)
        if item["type"].endswith("_type") or item["type"] in _SHOWS_INPUT:
            message += f", got {item['input']!r}"
        if item["type"] == "extra_forbidden":
            message = f"unknown key {loc[-1]!r}" if loc else "unknown key"
            loc = loc[:-1]
        where = _location(loc)
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)

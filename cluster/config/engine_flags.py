"""Command-line flags generated from `EngineArgs` (`--max-model-len`, `--enable-prefix-caching`...).

Each field becomes one flag in vLLM's spelling (underscores to dashes), typed by the field's JSON
schema, with the field's docstring as help; booleans take `--flag` / `--no-flag`, choices come
from `Literal` fields, a nested config (`--speculative-config`) takes a JSON object. Only flags
given on the command line are returned, so they can override a config file's `engine_kwargs`;
the values then go through `validate_engine_kwargs`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cluster.config.engine_args import EngineArgs

_DEST_PREFIX = "engine_arg__"
_PARSERS: dict[str, type] = {"integer": int, "number": float, "string": str}


def add_engine_arg_flags(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()
) -> argparse._ArgumentGroup:
    """Add one flag per `EngineArgs` field (except `skip`) to `parser`, in a group."""
    group = parser.add_argument_group("engine arguments (vLLM names)")
    properties = EngineArgs.model_json_schema()["properties"]
    for name, field in EngineArgs.model_fields.items():
        if name in skip:
            continue
        help_text = " ".join((field.description or "").split())
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=_DEST_PREFIX + name,
            default=argparse.SUPPRESS,
            help=f"{help_text} (default: {field.default!r})",
            **_value_options(name, properties[name]),
        )
    return group


def engine_kwargs_from_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments given on the command line, by field name."""
    return {
        key.removeprefix(_DEST_PREFIX): value
        for key, value in vars(namespace).items()
        if key.startswith(_DEST_PREFIX)
    }


def _value_options(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """How argparse reads one field's value, from its JSON schema (null aside)."""
    (value,) = [option for option in schema.get("anyOf", [schema]) if option.get("type") != "null"]
    if "$ref" in value:  # a nested config (speculative_config): JSON, as vLLM's flag takes it
        return {"type": _json_object, "metavar": "JSON"}
    if value["type"] == "object":  # limit_mm_per_prompt, mm_processor_kwargs: JSON, as vLLM's
        return {"type": _json_object, "metavar": "JSON"}
    if value["type"] == "array":  # allowed_media_domains: one or more values
        return {"type": _PARSERS[value["items"]["type"]], "nargs": "+", "metavar": name.upper()}
    if value["type"] == "boolean":
        return {"action": argparse.BooleanOptionalAction}
    if "enum" in value:
        return {"type": _PARSERS[value["type"]], "choices": value["enum"]}
    return {"type": _PARSERS[value["type"]], "metavar": name.upper()}


def _json_object(text: str) -> dict[str, Any]:
    """A flag value holding a JSON object (`--speculative-config '{"method": "ngram"}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value

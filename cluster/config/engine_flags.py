"""Command-line flags generated from `EngineArgs` (`--max-model-len`, `--enable-prefix-caching`...).

Each field becomes one flag in vLLM's spelling (underscores to dashes); booleans take
`--flag` / `--no-flag`. Only flags given on the command line are returned, so they can override
a config file's `engine_kwargs`; the values then go through `validate_engine_kwargs`.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Any

from cluster.config.engine_kwargs import engine_arg_types
from cluster.engine_args import EngineArgs

_DEST_PREFIX = "engine_arg__"


def _parser_type(allowed: tuple[type, ...]) -> type:
    for kind in (int, float, str):
        if kind in allowed:
            return kind
    return str


def add_engine_arg_flags(
    parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()
) -> argparse._ArgumentGroup:
    """Add one flag per `EngineArgs` field (except `skip`) to `parser`, in a group."""
    group = parser.add_argument_group("engine arguments (vLLM names)")
    docs = _field_docs()
    for name, allowed in engine_arg_types().items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        common: dict[str, Any] = {
            "dest": _DEST_PREFIX + name,
            "default": argparse.SUPPRESS,
            "help": docs.get(name),
        }
        if bool in allowed:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(flag, type=_parser_type(allowed), metavar=name.upper(), **common)
    return group


def engine_kwargs_from_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments given on the command line, by field name."""
    return {
        key.removeprefix(_DEST_PREFIX): value
        for key, value in vars(namespace).items()
        if key.startswith(_DEST_PREFIX)
    }


def _field_docs() -> dict[str, str]:
    """Each field's attribute docstring (read from the source) and its default, as help text."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(EngineArgs)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return {
        field.name: f"{docs.get(field.name, '')} (default: {field.default!r})".strip()
        for field in dataclasses.fields(EngineArgs)
    }

"""Command-line flags generated from `EngineArgs`: one `--flag-name` per engine argument.

The dataclass is the single source: names, types and defaults come from its fields, help texts
from its attribute docstrings, so a new engine argument is a new flag with nothing else to edit.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import textwrap
import types
import typing
from dataclasses import fields

from cluster.engine_args import EngineArgs

SKIPPED = frozenset({"model"})
"""Engine arguments with a flag of their own elsewhere (`--model`)."""


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add every engine argument as a flag whose default (None) means "not given"."""
    group = parser.add_argument_group("engine arguments (vLLM names)")
    helps = field_docs()
    hints = typing.get_type_hints(EngineArgs)
    for field in fields(EngineArgs):
        if field.name in SKIPPED:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(hints[field.name])
        help_text = f"{helps.get(field.name, '')} (default: {field.default})"
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag, type=kind, metavar=kind.__name__.upper(), help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The engine arguments given on the command line (flags left out keep their defaults)."""
    names = [f.name for f in fields(EngineArgs) if f.name not in SKIPPED]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def field_docs() -> dict[str, str]:
    """Attribute docstrings of `EngineArgs`: the string right after each annotated field."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(EngineArgs)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def _base_type(hint: object) -> type:
    """`int` for `int | None`, and so on."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        return typing.cast("type", inner)
    return typing.cast("type", hint)

"""`StructuredOutputsParams`: the constraint a request's output must satisfy (vLLM's shape).

Exactly one kind is set: `json` (a JSON schema, as a dict or its text), `json_object` (any JSON
object), `regex`, `choice` (one of the given strings), `grammar` (EBNF, or Lark for the
llguidance backend) or `structural_tag` (xgrammar's JSON description of tagged regions). The
object is frozen and hashable: a schema given as a dict is kept as compact JSON text, so equal
constraints share one compiled grammar. Only the shape is checked here; whether a schema, regex
or grammar is valid is decided by the backend that compiles it (the engine).
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.sampling_checks import check

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, init=False)
class StructuredOutputsParams:
    """One output constraint; `kind` and `spec` name it for the compiler."""

    json: str | None = None
    """A JSON schema as canonical JSON text (a dict is accepted)."""
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    """xgrammar's structural tag, as JSON text (a dict is accepted)."""
    backend: str | None = None
    """A backend for this request only (None: the engine's)."""

    def __init__(  # noqa: PLR0913 - one keyword per kind, as vLLM has
        self,
        *,
        json: str | Mapping[str, object] | bool | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: Sequence[str] | None = None,
        grammar: str | None = None,
        structural_tag: str | Mapping[str, object] | None = None,
        backend: str | None = None,
    ) -> None:
        self.__dict__.update(
            json=_json_text("json", json),
            json_object=json_object,
            regex=regex,
            choice=None if choice is None else _choices(choice),
            grammar=grammar,
            structural_tag=_json_text("structural_tag", structural_tag),
            backend=backend,
        )
        set_kinds = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        check(
            len(set_kinds) == 1,
            "structured_outputs must set exactly one of "
            f"{', '.join(KINDS)}; got {set_kinds or 'none'}",
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, str) and value != ""), f"{name} must be text")
        check(isinstance(json_object, bool), "json_object must be a bool")
        check(backend is None or isinstance(backend, str), "backend must be a name")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `KINDS`."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (the choices as a JSON list)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return jsonlib.dumps(list(value))
        return "" if value is True else str(value)


def _json_text(name: str, value: object) -> str | None:
    """None, or compact JSON text (key order kept: it orders the generated properties)."""
    if value is None:
        return None
    if value is True:  # vLLM accepts json=True for "any JSON"
        return jsonlib.dumps({"type": "object"})
    if isinstance(value, Mapping):
        return jsonlib.dumps(value, separators=(",", ":"))
    check(isinstance(value, str), f"{name} must be a JSON schema (a dict or its JSON text)")
    assert isinstance(value, str)
    try:
        parsed = jsonlib.loads(value)
    except jsonlib.JSONDecodeError as error:
        raise ValueError(f"{name} is not valid JSON: {error}") from None
    check(isinstance(parsed, dict), f"{name} must be a JSON object, got {value[:80]!r}")
    return jsonlib.dumps(parsed, separators=(",", ":"))


def _choices(value: object) -> tuple[str, ...]:
    check(
        isinstance(value, Sequence) and not isinstance(value, str),
        "choice must be a list of strings",
    )
    assert isinstance(value, Sequence)
    check(len(value) > 0, "choice must not be empty")
    check(all(isinstance(c, str) and c for c in value), "choice must hold non-empty strings")
    return tuple(value)

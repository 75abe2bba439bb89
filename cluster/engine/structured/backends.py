"""The grammar backends: xgrammar and llguidance behind one small interface.

A backend turns a `StructuredOutputsParams` into a compiled constraint in two stages: `parse`
(cheap, catches an invalid schema, regex or grammar as ValueError) and `compile` (the token-mask
precomputation over the vocabulary, the slow part, run in the compile thread). A `Matcher` is
one request's grammar state: it accepts sampled tokens and fills its row of the batch bitmask;
`fill_rows` fills the rows of many matchers of one backend at once (in parallel threads).

The JSON grammars allow no free whitespace between tokens (a small model can otherwise loop on
whitespace until `max_tokens`, and compact JSON is as valid as indented JSON), and objects admit
no properties beyond those a schema lists unless it says `additionalProperties` (xgrammar's
strict mode, OpenAI's strict structured outputs): every document still validates against the
schema, and a model cannot wander into inventing keys.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from scheduler.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

BACKENDS = ("xgrammar", "guidance")


class Matcher(Protocol):
    """One request's grammar state."""

    def accept(self, token_id: int) -> bool: ...

    def try_accept(self, token_id: int) -> bool:
        """Advance over `token_id` if the grammar allows it (False: state unchanged)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts)."""
        ...

    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    name: str

    def parse(self, params: StructuredOutputsParams) -> Any: ...

    def compile(self, parsed: Any) -> Any: ...

    def matcher(self, compiled: Any) -> Matcher: ...

    def fill_rows(
        self, matchers: Sequence[Matcher], rows: Sequence[int], bitmask: torch.Tensor
    ) -> None: ...


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose strings are exactly `choices` (JSON string literals escape them)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


@dataclass
class XgrammarMatcher:
    matcher: Any

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def try_accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))  # a refused token changes nothing

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend:
    """xgrammar: grammars compiled ahead into per-state token masks (slower compile); its
    `grammar` kind is EBNF."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def parse(self, params: StructuredOutputsParams) -> Any:
        grammar = self._xgr.Grammar
        kind = params.kind
        try:
            if kind == "json":
                return grammar.from_json_schema(params.spec, any_whitespace=False)
            if kind == "json_object":
                return grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return grammar.from_regex(params.spec)
            if kind == "choice":
                return grammar.from_ebnf(choice_ebnf(params.choice or ()))
            if kind == "grammar":
                return grammar.from_ebnf(params.spec)
            return grammar.from_structural_tag(params.spec)
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(
                f"invalid {kind} for structured outputs: {_first_line(error)}"
            ) from None

    def compile(self, parsed: Any) -> Any:
        return self._compiler.compile_grammar(parsed)

    def matcher(self, compiled: Any) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def fill_rows(
        self, matchers: Sequence[Matcher], rows: Sequence[int], bitmask: torch.Tensor
    ) -> None:
        inner = [m.matcher for m in matchers]  # type: ignore[attr-defined]
        self._batch.batch_fill_next_token_bitmask(inner, bitmask, list(rows))


@dataclass
class GuidanceMatcher:
    matcher: Any
    stop_token_ids: frozenset[int]
    num_tokens: int = 0
    """Tokens accepted so far."""
    ended_at: int | None = None
    """`num_tokens` when a stop token was accepted (llguidance reports `is_stopped` as soon as
    the grammar can only end, which is earlier: the end token must still be masked in)."""

    def accept(self, token_id: int) -> bool:
        return self._accepted(token_id, bool(self.matcher.consume_token(token_id)))

    def try_accept(self, token_id: int) -> bool:
        return self._accepted(token_id, self.matcher.try_consume_tokens([token_id]) == 1)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_tokens -= num_tokens
        if self.ended_at is not None and self.ended_at > self.num_tokens:
            self.ended_at = None

    def is_terminated(self) -> bool:
        return self.ended_at is not None

    def _accepted(self, token_id: int, accepted: bool) -> bool:
        if accepted:
            self.num_tokens += 1
            if token_id in self.stop_token_ids and self.ended_at is None:
                self.ended_at = self.num_tokens
        return accepted


class GuidanceBackend:
    """llguidance: an Earley parser computing each mask on demand (no compile, slower masks);
    its `grammar` kind is Lark."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        self._llg_torch = llguidance.torch
        eos = stop_token_ids[0] if stop_token_ids else None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size, eos_token=eos)
        self._stop_token_ids = frozenset(stop_token_ids)
        self._executor = llguidance.LLExecutor(2)

    def parse(self, params: StructuredOutputsParams) -> Any:
        matcher = self._llg.LLMatcher
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = closed_objects_text(params.spec) if kind == "json" else '{"type": "object"}'
            grammar = matcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(params.spec)
        elif kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in params.choice or ())
            grammar = matcher.grammar_from_lark(f"start: {alternatives}")
        elif kind == "grammar":
            grammar = matcher.grammar_from_lark(params.spec)
        else:
            raise ValueError("structural_tag needs the xgrammar backend")
        message = matcher.validate_grammar(grammar, self._tokenizer)
        if message:
            raise ValueError(f"invalid {kind} for structured outputs: {_first_line(message)}")
        return grammar

    def compile(self, parsed: Any) -> Any:
        return parsed  # llguidance builds its parser lazily, per matcher

    def matcher(self, compiled: Any) -> GuidanceMatcher:
        matcher = self._llg.LLMatcher(self._tokenizer, compiled)
        if matcher.is_error():
            raise ValueError(f"invalid grammar for structured outputs: {matcher.get_error()}")
        return GuidanceMatcher(matcher, self._stop_token_ids)

    def fill_rows(
        self, matchers: Sequence[Matcher], rows: Sequence[int], bitmask: torch.Tensor
    ) -> None:
        pairs = [(m.matcher, row) for m, row in zip(matchers, rows, strict=True)]  # type: ignore[attr-defined]
        self._llg_torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema listing properties
    that does not say otherwise."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _closed_member(key, value) for key, value in schema.items()}
    if "properties" in result and "additionalProperties" not in result:
        result["additionalProperties"] = False
    return result


def _closed_member(key: str, value: Any) -> Any:
    if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
        return {name: closed_objects(sub) for name, sub in value.items()}
    if key in _SUBSCHEMA_LISTS or key in ("items", "not", "if", "then", "else"):
        return closed_objects(value)
    return value


def closed_objects_text(spec: str) -> str:
    try:
        return json.dumps(closed_objects(json.loads(spec)))
    except json.JSONDecodeError as error:
        raise ValueError(f"invalid json for structured outputs: {error}") from None


def make_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
) -> GrammarBackend:
    """The backend called `name` ("xgrammar" or "guidance") over the model's tokenizer."""
    if name == "xgrammar":
        return XgrammarBackend(tokenizer, vocab_size, stop_token_ids)
    if name == "guidance":
        return GuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    raise ValueError(f"unknown structured outputs backend {name!r}; choose one of {BACKENDS}")


_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar prefixes its messages with `[time] file.cc:line: `."""


def _first_line(error: object) -> str:
    text = str(error).strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return _SOURCE_PREFIX.sub("", line)

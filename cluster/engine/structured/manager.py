"""`StructuredOutputManager`: the grammar states of the constrained requests, in the engine.

The states live next to the scheduler (one process, whatever the tensor-parallel size: the
sampled tokens come back from rank 0 to here anyway), so the workers only apply a bitmask:

    prepare(params)   compile in the background (the async engine calls it before queuing)
    add(requests)     a matcher per constrained request (waits for its compile if needed)
    with_bitmask(out) fill the rows of the scheduled constrained requests -> out.grammar_bitmask
                      (with speculative drafts: a row per draft position, the matcher advanced
                      over the drafts and rolled back)
    advance(outputs)  feed the accepted tokens to the matchers; finished requests leave

With async scheduling the engine calls `with_bitmask` for a step scheduled ahead only after
`advance` has fed the token that was in flight, so every row follows all the request's tokens.

A preempted request keeps its output tokens in the scheduler and resumes with them, so its
grammar state (which has accepted exactly those tokens) stays valid across the preemption.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import torch

from cluster.engine.structured.backends import GrammarBackend, Matcher, make_backend
from cluster.engine.structured.compile_cache import CompileCache
from scheduler.output import GrammarBitmask, RequestStepOutput, SchedulerOutput
from scheduler.request import Request, SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 60.0
"""A constraint not compiled by then is refused (400), so no request waits forever."""
AUTO_ORDER = ("guidance", "xgrammar")
"""`auto`: llguidance (compiles 3-10x faster, masks as fast at batch 256: docs/benchmarks.md),
xgrammar for what llguidance cannot parse (EBNF grammars, structural tags)."""


class StructuredOutputManager:
    """Compiles constraints and keeps one matcher per constrained request."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        backend: str = "auto",
        cache: CompileCache | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.backend = backend
        self.cache = cache if cache is not None else CompileCache()
        self.words_per_row = math.ceil(vocab_size / 32)
        self._backends: dict[str, GrammarBackend] = {}
        self.matchers: dict[str, tuple[GrammarBackend, Matcher]] = {}
        self._bitmask = torch.empty((0, self.words_per_row), dtype=torch.int32)

    def prepare(self, params: SamplingParams) -> Future[Any] | None:
        """Start compiling the request's constraint (None: it has none); ValueError when the
        constraint is invalid."""
        constraint = params.structured_outputs
        if constraint is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, and this model has none")
        name = constraint.backend or self.backend
        key = (name, constraint.kind, constraint.spec)
        return self.cache.get(key, lambda: self._parse(name, constraint))

    async def compiled_in_background(self, params: SamplingParams) -> None:
        """Compile the request's constraint while the event loop (and the step loop) go on;
        ValueError when it is invalid or takes longer than COMPILE_TIMEOUT_S."""
        future = self.prepare(params)
        if future is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise _too_slow() from None
        except Exception:  # a failed compile is reported by `add`
            pass

    def add(self, requests: Iterable[Request]) -> None:
        """A matcher for each constrained request; ValueError if its constraint is invalid."""
        for request in requests:
            future = self.prepare(request.sampling_params)
            if future is None:
                continue
            try:
                backend, compiled = future.result(timeout=COMPILE_TIMEOUT_S)
            except concurrent.futures.TimeoutError:
                raise _too_slow() from None
            except ValueError:
                raise
            except Exception as error:
                raise ValueError(f"the structured outputs constraint failed: {error}") from None
            self.matchers[request.req_id] = (backend, backend.matcher(compiled))

    def with_bitmask(self, output: SchedulerOutput) -> SchedulerOutput:
        """`output` with the bitmask rows of its scheduled constrained requests (1 + m rows for a
        request verifying m drafts, see `_draft_rows`)."""
        if not self.matchers:
            return output
        req_ids = [
            req_id
            for req_id in output.num_scheduled_tokens
            if req_id in self.matchers and not self.matchers[req_id][1].is_terminated()
        ]
        if not req_ids:
            return output
        drafts = output.scheduled_spec_tokens
        num_rows = [1 + len(drafts.get(req_id, ())) for req_id in req_ids]
        bitmask = self._rows(sum(num_rows))
        by_backend: dict[str, tuple[GrammarBackend, list[Matcher], list[int]]] = {}
        row = 0
        for req_id, count in zip(req_ids, num_rows, strict=True):
            backend, matcher = self.matchers[req_id]
            if count > 1:
                _draft_rows(backend, matcher, drafts[req_id], bitmask, row)
            else:
                entry = by_backend.setdefault(backend.name, (backend, [], []))
                entry[1].append(matcher)
                entry[2].append(row)
            row += count
        for backend, matchers, rows in by_backend.values():
            backend.fill_rows(matchers, rows, bitmask)
        data = bitmask[:row].numpy().tobytes()
        counts = tuple(num_rows) if row > len(req_ids) else ()
        return replace(
            output,
            grammar_bitmask=GrammarBitmask(tuple(req_ids), self.words_per_row, data, counts),
        )

    def advance(self, outputs: Iterable[RequestStepOutput]) -> None:
        """Feed each constrained request its new tokens; finished requests leave."""
        for out in outputs:
            entry = self.matchers.get(out.req_id)
            if entry is None:
                continue
            for token in out.new_token_ids:
                if not entry[1].accept(token):
                    logger.warning("request %s: token %d breaks its grammar", out.req_id, token)
            if out.finished:
                del self.matchers[out.req_id]

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.matchers.pop(req_id, None)

    def _rows(self, num_rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.empty(
                (max(num_rows, 2 * self._bitmask.shape[0]), self.words_per_row), dtype=torch.int32
            )
        return self._bitmask

    def _parse(
        self, name: str, constraint: StructuredOutputsParams
    ) -> Callable[[], tuple[GrammarBackend, Any]]:
        """Parse with the named backend (auto: the first of AUTO_ORDER that accepts it)."""
        candidates = AUTO_ORDER if name == "auto" else (name,)
        errors: list[ValueError] = []
        for candidate in candidates:
            backend = self._backend(candidate)
            try:
                parsed = backend.parse(constraint)
            except ValueError as error:
                errors.append(error)
                continue
            return lambda: (backend, backend.compile(parsed))
        raise _combined(errors)

    def _backend(self, name: str) -> GrammarBackend:
        if name not in self._backends:
            self._backends[name] = make_backend(
                name, self.tokenizer, self.vocab_size, self.stop_token_ids
            )
        return self._backends[name]


def _draft_rows(
    backend: GrammarBackend,
    matcher: Matcher,
    drafts: Sequence[int],
    bitmask: torch.Tensor,
    first_row: int,
) -> None:
    """Rows `first_row` .. `first_row + len(drafts)`: the mask before each draft and after the
    last, from a matcher advanced over the drafts and rolled back to where it was (the grammar
    only ever keeps accepted tokens: `advance` feeds them after the step). After a draft the
    grammar refuses, the remaining rows repeat the last mask: the verifier rejects that draft
    (the mask gives it probability 0), so those rows are never sampled from. After a draft
    that ends the grammar the rows allow everything, as a finished grammar does."""
    backend.fill_rows([matcher], [first_row], bitmask)
    num_accepted = 0
    for index, token in enumerate(drafts, start=1):
        rest = slice(first_row + index, first_row + len(drafts) + 1)
        if not matcher.try_accept(token):
            bitmask[rest] = bitmask[first_row + index - 1]
            break
        num_accepted += 1
        if matcher.is_terminated():
            bitmask[rest] = -1  # as without drafts: a finished grammar constrains nothing
            break
        backend.fill_rows([matcher], [first_row + index], bitmask)
    if num_accepted:
        matcher.rollback(num_accepted)


def _too_slow() -> ValueError:
    return ValueError(
        f"the structured outputs constraint did not compile within {COMPILE_TIMEOUT_S:g} s"
    )


def _combined(errors: list[ValueError]) -> ValueError:
    """One error naming what each backend found (an EBNF grammar fails Lark's parser first)."""
    if len(errors) == 1:
        return errors[0]
    first, *others = (str(error) for error in errors)
    details = "; ".join(other.split(": ", 1)[-1] for other in others)
    return ValueError(f"{first}; {details}")

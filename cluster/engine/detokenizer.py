"""Incremental detokenization of one request: text deltas token by token, and stop strings.

The engine makes one `IncrementalDetokenizer` per completion and feeds it the sampled tokens;
`update` returns the new text. Technique (prefix/read offsets over a small decode window):

    window ids   [ context (already emitted) | newer tokens ]   decoded together each token
    window text  [ emitted .............. | new, stable | held ]
                   `_window_done` chars      -> delta     -> waits for the next token

Decoding a few tokens of context before the new ones keeps what depends on the left neighbour
right (SentencePiece drops the leading space of a sequence's first token; byte-level and
byte-fallback tokens complete a character only together). Text that may still change is held
back: a trailing U+FFFD (an incomplete UTF-8 sequence); the text of a trailing run of byte-
fallback tokens (`<0xNN>`: such a run is decoded as a whole, so one more incomplete byte turns
the characters it already formed into U+FFFD); and, for tokenizers that clean up tokenization
spaces, the last few characters from a space on. Once the whole window is emitted
it shrinks back to its context, so each token costs one decode of a handful of tokens.

On top of that stable text, stop strings (`SamplingParams.stop`) are searched across token
boundaries once `min_tokens` output tokens exist; the text is cut before the first one (after
it with `include_stop_str_in_output`), and while streaming, a tail that could still grow into a
stop string is held back until it cannot. The deltas joined equal
`decode(prompt + output)[len(decode(prompt)):]` (with no prompt: `decode(output)`) with the
request's `skip_special_tokens` and `spaces_between_special_tokens`, cut at the stop string.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from cluster.engine.stop_strings import find_stop, partial_stop_len
from scheduler.request import SamplingParams

CONTEXT_TOKENS = 5
"""Tokens kept before the unread ones when the window shrinks (as vLLM's initial offset)."""
REPLACEMENT_CHAR = "\ufffd"
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""How byte-fallback tokens are spelled (SentencePiece, Llama, Mistral, Gemma)."""
CLEANUP_SPAN = 3
"""Space clean-up rewrites patterns of at most 4 characters starting with a space (" n't")."""


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        spaces_between_special_tokens: bool = ...,
    ) -> str: ...

    def convert_ids_to_tokens(self, ids: int) -> str: ...


class IncrementalDetokenizer:
    """Turns one completion's tokens into text as they arrive; finds its stop strings."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._cleans_spaces = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._window = list(prompt_token_ids[-CONTEXT_TOKENS:])
        """Ids decoded together: context, then tokens whose text is not all emitted."""
        self._window_done = len(self._decode(self._window))
        self._byte_run_start: int | None = None
        """Window index where a trailing run of byte-fallback tokens starts."""
        """Characters of the window's text already moved into `_text`."""
        self._text = ""
        """Stable output text, before the stop-string hold-back."""
        self._num_sent = 0
        """Characters of `_text` returned by `update` so far."""
        self._num_tokens = 0
        self.stop_reason: str | None = None
        """The stop string that ended the request, once one did."""

    @property
    def output_text(self) -> str:
        """All text returned so far (the complete text once finished)."""
        return self._text[: self._num_sent]

    @property
    def num_output_tokens(self) -> int:
        """Tokens fed through `update`."""
        return self._num_tokens

    @property
    def finished_by_stop_string(self) -> bool:
        """A stop string ended the request: the engine must stop (abort) it."""
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int], final: bool = False) -> str:
        """Feed sampled tokens; return the text they add (possibly empty).

        `final`: the request ended for another reason (EOS, stop token, length, abort), so
        everything held back is released. Tokens after a stop string are ignored.
        """
        for token_id in new_token_ids:
            if self.finished_by_stop_string:
                break
            self._append(token_id)
        if final and not self.finished_by_stop_string:
            self._release_window()
        return self._emit(final)

    def _append(self, token_id: int) -> None:
        self._window.append(token_id)
        self._num_tokens += 1
        text = self._decode(self._window)
        stable = len(text) - self._unstable_len(text)
        if BYTE_TOKEN.fullmatch(self._tokenizer.convert_ids_to_tokens(token_id) or ""):
            if self._byte_run_start is None:
                self._byte_run_start = len(self._window) - 1
            stable = min(stable, len(self._decode(self._window[: self._byte_run_start])))
        else:
            self._byte_run_start = None
        if stable > self._window_done:
            self._add_text(text[self._window_done : stable])
            self._window_done = stable
        if self._window_done == len(text) and len(self._window) > 2 * CONTEXT_TOKENS:
            self._shrink_window()

    def _add_text(self, new_text: str) -> None:
        """Append stable text; search it for stop strings once `min_tokens` is reached."""
        new_from = len(self._text)
        self._text += new_text
        params = self._params
        if not params.stop or self._num_tokens < params.min_tokens:
            return
        match = find_stop(self._text, params.stop, new_from)
        if match is not None:
            end = match.start + (len(match.stop) if params.include_stop_str_in_output else 0)
            self._text = self._text[: max(end, self._num_sent)]
            self.stop_reason = match.stop

    def _release_window(self) -> None:
        text = self._decode(self._window)
        if len(text) > self._window_done:
            self._add_text(text[self._window_done :])
            self._window_done = len(text)

    def _shrink_window(self) -> None:
        """Keep only the context; skipped when the context would start inside a character."""
        context = self._window[-CONTEXT_TOKENS:]
        text = self._decode(context)
        if not text.startswith(REPLACEMENT_CHAR):
            self._window = context
            self._window_done = len(text)

    def _emit(self, final: bool) -> str:
        end = len(self._text)
        params = self._params
        streaming = not (final or self.finished_by_stop_string)
        if params.stop and streaming and not params.include_stop_str_in_output:
            end -= partial_stop_len(self._text[self._num_sent :], params.stop)
        delta = self._text[self._num_sent : end]
        self._num_sent = max(self._num_sent, end)
        return delta

    def _unstable_len(self, text: str) -> int:
        """Trailing characters of the window text that a later token may still change."""
        stable = text.rstrip(REPLACEMENT_CHAR)
        if self._cleans_spaces:
            space = stable.find(" ", max(0, len(stable) - CLEANUP_SPAN))
            if space >= 0:
                stable = stable[:space]
        return len(text) - len(stable)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._params.skip_special_tokens,
            spaces_between_special_tokens=self._params.spaces_between_special_tokens,
        )

"""Incremental detokenization: one sequence's text, grown token by token, cut at stop strings.

Decoding the whole output at every step costs O(n) per token; instead each step decodes a short
window: the tokens from `prefix_offset` (already emitted, decoded again only as context) to the
end, and keeps what goes beyond the decode of the context alone. Because both decodes start at
the same token, tokenizer rules that depend on the first token (SentencePiece drops the leading
space of a sequence) cancel out, and a window ending in an incomplete UTF-8 sequence (byte-level
BPE or byte-fallback tokens, seen as U+FFFD) is held back until the next tokens complete it:

    ids:  [ ... emitted ... | context | new tokens ]
                 prefix_offset ┘       └ read_offset

Stop strings are searched in the text itself, so they are found across token boundaries; while
a request streams, the last `longest stop string - 1` characters are held back (they may still
turn out to begin a stop string) and released by `finish()` when the request ends otherwise.
"""

from __future__ import annotations

from typing import Any

from scheduler.request import SamplingParams

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence; `update` returns what is new, `finish` what was held back."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._stops = params.stop
        self._hold = max((len(stop) for stop in self._stops), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.output_text = ""
        """All text decoded so far (cut at the stop string once one is found)."""
        self._num_emitted = 0
        self.stop_reason: str | None = None

    @property
    def finished_by_stop_string(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; the text that became final (for streaming)."""
        if self._tokenizer is None or self.stop_reason is not None or not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        searched_from = len(self.output_text)
        self.output_text += self._decode_new()
        if len(self._ids) >= self._params.min_tokens:
            self._check_stop(searched_from)
        end = len(self.output_text) if self.stop_reason else len(self.output_text) - self._hold
        return self._emit(end)

    def finish(self) -> str:
        """The held-back text, once the sequence has ended."""
        return self._emit(len(self.output_text))

    def _emit(self, end: int) -> str:
        if end <= self._num_emitted:
            return ""
        text = self.output_text[self._num_emitted : end]
        self._num_emitted = end
        return text

    def _decode(self, ids: list[int]) -> str:
        return str(
            self._tokenizer.decode(
                ids,
                skip_special_tokens=self._params.skip_special_tokens,
                spaces_between_special_tokens=self._params.spaces_between_special_tokens,
            )
        )

    def _decode_new(self) -> str:
        """Text of the tokens after `read_offset`, or "" while it ends mid-character."""
        context = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if text.endswith(_INCOMPLETE) or len(text) <= len(context):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(context) :]

    def _check_stop(self, searched_from: int) -> None:
        """Cut the text at the first stop string that ends in the new text."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.output_text.find(stop, max(0, searched_from - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return
        index, stop = best
        keep = (
            index + len(stop)
            if getattr(self._params, "include_stop_str_in_output", False)
            else index
        )
        self.output_text = self.output_text[:keep]
        self._num_emitted = min(self._num_emitted, keep)
        self.stop_reason = stop

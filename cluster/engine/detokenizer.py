"""Incremental detokenization with stop strings (simple full-decode version)."""

from __future__ import annotations

from typing import Any

from scheduler.request import SamplingParams


class IncrementalDetokenizer:
    """Text of one sequence, grown token by token; ends the sequence at a stop string."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None

    @property
    def finished_by_stop_string(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the new text."""
        if self._tokenizer is None or self.stop_reason is not None:
            return ""
        self._token_ids.extend(new_token_ids)
        text = str(self._tokenizer.decode(self._token_ids, skip_special_tokens=True))
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.output_text) :]
        self.output_text = text
        return delta

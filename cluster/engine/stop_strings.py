"""Stop strings over growing text: where one ends the request, and how much to hold back.

Pure string functions used by the incremental detokenizer; a match may span any number of
tokens, since they run on the text, not on tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """A stop string found in the text."""

    start: int
    """Index of its first character."""
    stop: str


def find_stop(text: str, stops: Sequence[str], new_from: int) -> StopMatch | None:
    """The earliest stop string in `text` that ends at or after index `new_from`.

    Matches ending before `new_from` were checked (or skipped, before min_tokens) earlier.
    Ties at the same start go to the longer string, then to the order of `stops`.
    """
    best: StopMatch | None = None
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start < 0:
            continue
        if best is None or (start, -len(stop)) < (best.start, -len(best.stop)):
            best = StopMatch(start, stop)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string.

    That tail may still become a stop string, so streaming holds it back; 0 when none.
    """
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest

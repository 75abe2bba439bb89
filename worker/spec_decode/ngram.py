"""N-gram (prompt lookup) drafts: the tokens that followed the latest earlier occurrence of the
context's last n tokens, for the longest n in [min_n, max_n] that occurs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], min_n: int, max_n: int, num_drafts: int) -> list[int]:
    """Up to `num_drafts` tokens continuing the latest match of the longest matching tail."""
    if num_drafts < 1 or len(token_ids) <= min_n:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for size in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        # [num_windows, size]: every window that ends before the last token
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], size)
        starts = np.flatnonzero((windows == tokens[-size:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + size
            return [int(token) for token in tokens[follow : follow + num_drafts]]
    return []

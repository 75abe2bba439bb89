"""The configuration keys a replay trace may carry, and the warnings for the others.

`scheduler.replay` calls `unknown_key_warnings` on every trace: a misspelt key (`enable_cachng`)
would otherwise be silently ignored. Free-form notes belong under the top-level `meta` key.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

TOP_LEVEL_KEYS = frozenset(
    {
        "groups",
        "num_blocks",
        "max_model_len",
        "enable_caching",
        "cache_unreachable_blocks",
        "prefix_cache_eviction",
        "mamba_cache_mode",
        "prefix_match_unit",
        "kv_offloading_blocks",
        "kv_offloading_eviction",
        "num_speculative_tokens",
        "ops",
        "meta",
    }
)
"""Keys a trace object may hold (`meta` holds anything: names, notes, expected values)."""

GROUP_KEYS = frozenset(
    {"type", "block_size", "sliding_window", "attention_chunk_size", "num_layers"}
)
"""Keys one entry of `groups` may hold."""


def _warning(where: str, key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown key {key!r} in {where} is ignored{hint} (put notes under 'meta')"


def unknown_key_warnings(trace: Mapping[str, Any]) -> list[str]:
    """One message per key the replay does not read, at the top level and in each group."""
    warnings = [
        _warning("the trace", str(key), TOP_LEVEL_KEYS)
        for key in trace
        if key not in TOP_LEVEL_KEYS
    ]
    groups = trace.get("groups")
    if isinstance(groups, list):
        for index, entry in enumerate(groups):
            if isinstance(entry, dict):
                warnings.extend(
                    _warning(f"groups[{index}]", str(key), GROUP_KEYS)
                    for key in entry
                    if key not in GROUP_KEYS
                )
    return warnings

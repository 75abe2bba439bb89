"""Replay traces that put a small pool under pressure with shared prefixes (for the replay tool).

Used by the tests and the benchmark that compare the two caching policies: registering every
full block (vLLM) or only the blocks some prefix hit can use (ours). Deterministic per seed.

    documents ─► prompts = a document's prefix + a private tail ─► prefill, decode, free (random)
"""

from __future__ import annotations

import random
from typing import Any

LAYOUTS: dict[str, list[dict[str, Any]]] = {
    "full8+window5/4": [
        {"type": "full", "block_size": 8},
        {"type": "sliding_window", "block_size": 4, "sliding_window": 5},
    ],
    "full16+window9/4": [
        {"type": "full", "block_size": 16},
        {"type": "sliding_window", "block_size": 4, "sliding_window": 9, "num_layers": 3},
    ],
    "full4+chunk8/4": [
        {"type": "full", "block_size": 4},
        {"type": "chunked_local", "block_size": 4, "attention_chunk_size": 8},
    ],
    "full8+mamba4": [
        {"type": "full", "block_size": 8},
        {"type": "mamba", "block_size": 4},
    ],
}
"""Layouts where some blocks are unreachable (block size below the hit alignment, windows
shorter than it, the last block of every chunk, Mamba states off the alignment grid)."""

ALL_REACHABLE: dict[str, list[dict[str, Any]]] = {
    "full4+window9/4": [
        {"type": "full", "block_size": 4},
        {"type": "sliding_window", "block_size": 4, "sliding_window": 9},
    ],
    "full4": [{"type": "full", "block_size": 4}],
}
"""Layouts where every block is reachable: both policies must give identical results."""


def pressure_trace(
    groups: list[dict[str, Any]], seed: int, num_blocks: int = 48, num_requests: int = 40
) -> dict[str, Any]:
    """A trace of `num_requests` prompts over 4 shared documents, at most 3 live at a time."""
    rng = random.Random(seed)
    documents = [[rng.randrange(1, 1000) for _ in range(64)] for _ in range(4)]
    ops: list[dict[str, Any]] = []
    live: list[str] = []
    for number in range(num_requests):
        if len(live) >= 3 or (live and rng.random() < 0.4):
            ops.append({"op": "free", "id": live.pop(rng.randrange(len(live)))})
        document = rng.choice(documents)
        prefix = document[: rng.randrange(8, len(document) + 1)]
        tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))]
        request_id = f"r{number}"
        ops.append({"op": "prefill", "id": request_id, "tokens": prefix + tail})
        ops.append({"op": "decode", "id": request_id, "tokens": [rng.randrange(1, 2000)]})
        live.append(request_id)
    ops.extend({"op": "free", "id": request_id} for request_id in live)
    return {
        "groups": groups,
        "num_blocks": num_blocks,
        "max_model_len": 256,
        "prefix_cache_eviction": "lru",  # the registration policies compared in vLLM's order
        "ops": ops,
    }


def hit_tokens(results: list[dict[str, Any]]) -> list[int]:
    """The hit length of every prefill record, in op order."""
    return [record["hit_tokens"] for record in results if record["op"] == "prefill"]

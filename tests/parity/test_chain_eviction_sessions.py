"""Round-robin chat sessions on a tiny sliding-window model (Gemma 3 layout) in a KV pool too
small for all of them: with the `chain` eviction policy (and with `lru`), every greedy token
equals a run without prefix caching, every later turn of `chain` hits the cache, and `chain`
keeps whole histories where LRU keeps none."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.parity

NUM_SESSIONS = 4
NUM_ROUNDS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=4)
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "kv_cache_memory_bytes": 72 << 10,  # 72 blocks: one long request, not four sessions
}


def _sessions(path: Path, **kwargs: object) -> tuple[list[list[int]], list[int]]:
    """(greedy tokens, cached tokens) of every turn, session after session in each round."""
    llm = LLM(str(path), **LLM_ARGS, **kwargs)
    histories = [[7, 3, 9, 1, 4, 4, 2, 8] + [20 + s] * 3 for s in range(NUM_SESSIONS)]
    tokens, cached = [], []
    try:
        for round_index in range(NUM_ROUNDS):
            for session, history in enumerate(histories):
                history.extend([(31 * session + 7 * round_index + i) % 250 for i in range(5)])
                (result,) = llm.generate([{"prompt_token_ids": history}], GREEDY, use_tqdm=False)
                output = list(result.outputs[0].token_ids)
                tokens.append(output)
                cached.append(result.num_cached_tokens)
                history.extend(output)
    finally:
        llm.shutdown()
    return tokens, cached


def test_sessions_with_chain_eviction_give_the_tokens_of_no_caching(tmp_path: Path) -> None:
    """Both policies give the uncached tokens; in the last round LRU has evicted every session's
    history (each turn hits only the shared 8 tokens) while `chain` still hits some whole."""
    save_tiny_model("gemma3", tmp_path)
    expected, _ = _sessions(tmp_path, enable_prefix_caching=False)
    last_round = {}
    for policy in ("chain", "lru"):
        tokens, cached = _sessions(tmp_path, prefix_cache_eviction=policy)
        assert tokens == expected, policy
        last_round[policy] = cached[-NUM_SESSIONS:]
        if policy == "chain":
            assert all(hits > 0 for hits in cached[NUM_SESSIONS:]), cached
    assert max(last_round["lru"]) == 8
    assert max(last_round["chain"]) > 8


def test_async_steps_cache_the_blocks_of_synchronous_steps(tmp_path: Path) -> None:
    """A request that finishes with tokens computed ahead (async scheduling, the default) leaves
    the same blocks in the prefix cache as with synchronous steps: every turn hits as much."""
    save_tiny_model("gemma3", tmp_path)
    sync_tokens, sync_cached = _sessions(tmp_path, async_scheduling=False)
    tokens, cached = _sessions(tmp_path, async_scheduling=True)
    assert tokens == sync_tokens
    assert cached == sync_cached
    assert max(cached) > 8  # whole histories hit

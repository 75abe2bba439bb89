"""The offload tier over two tensor-parallel ranks (spawned processes, gloo, CPU fp32): chat
sessions take turns in a device pool too small for all of them, so later turns hit blocks the
pool evicted and the tier keeps, in host memory and in block files (each rank its own shard);
every token (greedy and seeded) equals the same two ranks without prefix caching or tier.

A cheap form of the `slow` restart test in test_offload_tier_engine.py: one tiered engine, a
few sessions and two rounds. The ranks' agreement on each load is unit-tested in
tests/unit/worker/test_offload_ranks.py; here the loaded blocks feed real forwards on both ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM
from scheduler.kv_cache.builder import block_bytes, request_blocks
from tests.helpers.session_turns import session_turns
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.parity

NUM_SESSIONS = 4
NUM_ROUNDS = 2
LLM_ARGS = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 32, "max_model_len": 64}
SPARE_BLOCKS = 4
HOST_BLOCKS = 16
"""Host level of the tier, in bytes of pool blocks: older entries spill to the disk level, so the
second round loads from both levels."""


def _turns(llm: LLM) -> list[list[int]]:
    """Tokens of every turn, session after session in each round."""
    return session_turns(llm, NUM_SESSIONS, NUM_ROUNDS)


def _untiered_turns(model: Path) -> tuple[list[list[int]], int, int]:
    """Two ranks, no prefix caching, no tier: the turns' tokens, and the pool's shape on a rank
    (blocks of one longest request plus a few, bytes per block)."""
    llm = LLM(
        str(model),
        **LLM_ARGS,
        tensor_parallel_size=2,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 22,
    )
    try:
        config = llm.client.core.scheduler.kv_cache_config  # type: ignore[attr-defined]
        num_blocks = request_blocks(config, LLM_ARGS["max_model_len"]) + SPARE_BLOCKS
        return _turns(llm), num_blocks, block_bytes(config)
    finally:
        llm.shutdown()


def test_two_ranks_load_host_and_disk_blocks_and_give_the_untiered_tokens(tmp_path: Path) -> None:
    model, kv_dir = tmp_path / "model", tmp_path / "kv"
    save_tiny_model("gemma3", model)
    expected, num_blocks, size = _untiered_turns(model)
    llm = LLM(
        str(model),
        **LLM_ARGS,
        tensor_parallel_size=2,
        kv_cache_memory_bytes=num_blocks * size,
        kv_offloading_size=HOST_BLOCKS * size / 2**30,
        kv_offloading_dir=str(kv_dir),
        kv_offloading_disk_size=0.01,
    )
    try:
        tokens = _turns(llm)
        stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
    assert tokens == expected
    assert stats.offload is not None
    assert stats.offload.loaded_bytes > stats.offload.disk_loaded_bytes > 0, stats.offload
    assert stats.offload.num_failed_loads == 0
    (rank0,) = [p for p in kv_dir.iterdir() if not p.name.endswith("-rank1")]
    rank1 = rank0.with_name(f"{rank0.name}-rank1")
    assert sorted(p.name for p in rank1.glob("*.kv")) == sorted(p.name for p in rank0.glob("*.kv"))

"""A replica's offload tier as the source of a KV transfer (tiny random Bamba, CPU fp32): the
sender's pool is too small to keep a prompt's prefix, its host tier (or, below a two-block host
tier, its disk tier) holds it; the export reads those pages from the tier (the sender computes
nothing), and the receiver's tokens equal one engine's with no cache."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from cluster import LLM
from cluster.engine.kv_transfer import kv_export, kv_held_keys, kv_import
from scheduler.kv_cache.builder import block_bytes, request_blocks
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.parity.test_kv_transfer_engine import (
    LLM_ARGS,
    PARAMS,
    PROMPT,
    core_of,
    generate,
    prefill_all_but_last,
)

pytestmark = pytest.mark.parity

OTHER = [(11 * i + 5) % 250 + 1 for i in range(100)]
"""A prompt that takes the sender's pool after `PROMPT` (evicting it to the tier)."""
SPARE_BLOCKS = 4


class Model(NamedTuple):
    path: Path
    expected: list[int]
    """Greedy tokens of `PROMPT` from one engine with no cache."""
    num_blocks: int
    """Blocks of one longest request plus a few: a pool that cannot keep `PROMPT` and `OTHER`."""
    block_bytes: int


@pytest.fixture(scope="module")
def bamba(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("bamba")
    save_tiny_hybrid("bamba", path)
    cold = LLM(str(path), **LLM_ARGS, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 22)
    try:
        expected = generate(cold, PROMPT, PARAMS["greedy"])
        config = core_of(cold).scheduler.kv_cache_config
        num_blocks = request_blocks(config, LLM_ARGS["max_model_len"]) + SPARE_BLOCKS
        return Model(path, expected, num_blocks, block_bytes(config))
    finally:
        cold.shutdown()


@pytest.mark.parametrize("level", ["host", "disk"])
def test_a_prefix_in_the_senders_tier_is_sent_from_there(
    bamba: Model, tmp_path: Path, level: str
) -> None:
    size = bamba.block_bytes
    tier: dict[str, object] = {"kv_offloading_size": 0.01}
    if level == "disk":
        tier = {
            "kv_offloading_size": 2 * size / 2**30,
            "kv_offloading_dir": str(tmp_path / "kv"),
            "kv_offloading_disk_size": 0.01,
        }
    pool = {"kv_cache_memory_bytes": bamba.num_blocks * size}
    sender = LLM(str(bamba.path), **LLM_ARGS, **pool, **tier)
    receiver = LLM(str(bamba.path), **LLM_ARGS)
    try:
        prefill_all_but_last(sender, PROMPT)
        prefill_all_but_last(sender, OTHER)
        send, take = core_of(sender), core_of(receiver)
        before = send.get_stats()
        transfer = kv_export(send, PROMPT, kv_held_keys(take, PROMPT))
        keys = transfer.keys
        assert keys.num_hit_tokens >= 48, keys  # the tier's part of the prefix too
        assert keys.num_tier_blocks > 0
        after = send.get_stats()  # read from the tier: nothing loaded into the pool or hit
        assert after.offload == before.offload
        assert after.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens
        kv_import(take, transfer)
        assert generate(receiver, PROMPT, PARAMS["greedy"]) == bamba.expected
        assert take.get_stats().prefix_cache_hit_tokens == keys.num_hit_tokens
    finally:
        sender.shutdown()
        receiver.shutdown()

"""KV pages of another dtype are never read: the offload tier's disk folder and the KV transfer
fingerprint name the pages' dtypes, so a bf16 engine neither adopts the block files of an fp8
engine nor imports its pages (the transfer is refused, saying which dtypes differ); and fp8
halves the bytes a block or token moves."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kv_cache_helpers import make_manager, make_request

from benchmarks.workloads.hybrid_capacity import GRANITE_4_H_SMALL, hybrid_layer_specs
from scheduler.config import OffloadConfig
from scheduler.kv_cache.builder import build_kv_cache_config
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.offload_levels import group_block_bytes, layout_fingerprint
from scheduler.kv_cache.spec import AttentionSpec, FullAttentionSpec, KVCacheSpec, manager_spec
from scheduler.kv_cache.transfer import find_export, held_keys, transfer_fingerprint

BLOCK = 4
GIB = 1 << 30
PROMPT = list(range(17))
BF16 = "kv bfloat16, state bfloat16"
FP8 = "kv fp8_e4m3, state bfloat16"


def _attention(kv_bytes: int) -> KVCacheSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype_bytes=kv_bytes)


def _manager_with_disk(kv_bytes: int, folder: str) -> KVCacheManager:
    manager = make_manager(6, _attention(kv_bytes))
    manager.enable_offload(OffloadConfig(1 << 10, folder, 1 << 16, "model-a"))
    return manager


def _disk_blocks(manager: KVCacheManager) -> int:
    offload = manager.make_stats().offload
    assert offload is not None
    return offload.disk_num_blocks


def test_block_files_of_an_fp8_cache_are_not_adopted_by_a_bf16_one(tmp_path) -> None:
    """Block files left by an fp8 engine sit in its fingerprint's folder: a restarted fp8 engine
    adopts them and hits; a bf16 engine of the same model looks in another folder."""
    fp8_probe = make_manager(6, _attention(1))
    folder = tmp_path / layout_fingerprint(fp8_probe._config, "model-a")
    folder.mkdir()
    hashes = make_request("x", PROMPT, BLOCK).block_hashes
    for slot, block_hash in enumerate(hashes[:2]):
        (folder / f"g0-{block_hash.hex()}-{slot}.kv").write_bytes(b"x")
    fp8 = _manager_with_disk(1, str(tmp_path))
    bf16 = _manager_with_disk(2, str(tmp_path))
    assert _disk_blocks(fp8) == 2
    assert fp8.get_computed_blocks(make_request("a", PROMPT, BLOCK)).num_tokens == 2 * BLOCK
    assert _disk_blocks(bf16) == 0
    assert bf16.get_computed_blocks(make_request("a", PROMPT, BLOCK)).num_tokens == 0


@pytest.mark.parametrize(
    ("sender_dtypes", "receiver_dtypes"),
    [(FP8, BF16), ("kv fp8_e5m2, state bfloat16", FP8), (BF16, "kv bfloat16, state float16")],
)
def test_a_transfer_between_cache_dtypes_is_refused_naming_both(
    sender_dtypes: str, receiver_dtypes: str
) -> None:
    """Even at equal element sizes (e4m3 and e5m2; bf16 and fp16 state), pages of another
    encoding are refused, and the message names both encodings."""
    sender, receiver = make_manager(20, _attention(1)), make_manager(20, _attention(1))
    theirs = transfer_fingerprint(receiver._config, "model-a", receiver_dtypes)
    ours = transfer_fingerprint(sender._config, "model-a", sender_dtypes)
    hashes = make_request("x", PROMPT, BLOCK).block_hashes
    with pytest.raises(ValueError, match="cache dtypes") as refused:
        find_export(sender, hashes, len(PROMPT) - 1, held_keys(receiver, hashes, theirs), ours)
    assert sender_dtypes in str(refused.value)
    assert receiver_dtypes in str(refused.value)


def test_equal_cache_dtypes_give_one_transfer_fingerprint() -> None:
    sender, receiver = make_manager(20, _attention(1)), make_manager(40, _attention(1))
    assert transfer_fingerprint(sender._config, "m", FP8) == transfer_fingerprint(
        receiver._config, "m", FP8
    )


def test_fp8_halves_the_bytes_an_attention_block_moves() -> None:
    bf16 = build_kv_cache_config({"layer": _attention(2)}, 1 << 20)
    fp8 = build_kv_cache_config({"layer": _attention(1)}, 1 << 20)
    assert fp8.block_sizes == bf16.block_sizes
    assert group_block_bytes(fp8) == tuple(size // 2 for size in group_block_bytes(bf16))


def test_fp8_halves_the_bytes_a_hybrids_attention_token_moves_and_keeps_state_blocks() -> None:
    """Granite-4.0-H-Small-shaped: pages are unified with the state's, so an attention block
    moves as many bytes as before but holds twice the tokens; a state block moves its state."""
    per_token, state_bytes = {}, {}
    for kv_bytes in (2, 1):
        shape = replace(GRANITE_4_H_SMALL, dtype_bytes=kv_bytes)
        config = build_kv_cache_config(hybrid_layer_specs(shape, 16), 8 * GIB)
        block_bytes = group_block_bytes(config)
        kinds = [isinstance(manager_spec(g.spec), AttentionSpec) for g in config.groups]
        attention = kinds.index(True)
        per_token[kv_bytes] = block_bytes[attention] / config.groups[attention].spec.block_size
        state_bytes[kv_bytes] = block_bytes[kinds.index(False)]
    assert per_token[1] == per_token[2] / 2
    assert state_bytes[1] == state_bytes[2]

"""Chained block hashes (scenario S01).

S01 parts 4 and 5 (multimodal item identifiers and LoRA names as extra keys) are not tested: our
requests carry neither; the cache salt is the only extra key.
"""

from __future__ import annotations

import subprocess
import sys

from kv_cache_helpers import P3, admit, make_manager, make_request

from scheduler.block_hash import SEED, extend_block_hashes, hash_block_tokens
from scheduler.kv_cache.spec import FullAttentionSpec


def test_only_full_blocks_are_hashed_and_hashes_grow_with_output() -> None:
    request = make_request("r", P3 + [3] * 11, 16)
    assert len(request.block_hashes) == 3
    request.append_output_token_ids([4] * 5)
    assert len(request.block_hashes) == 4
    tokens = request.all_token_ids
    assert request.block_hashes[3] == hash_block_tokens(request.block_hashes[2], tokens[48:64])


def test_each_hash_chains_its_parent() -> None:
    tokens = P3 + [3] * 11
    hashes = make_request("r", tokens, 16).block_hashes
    assert hashes[0] == hash_block_tokens(None, tokens[0:16])
    assert hashes[0] == hash_block_tokens(SEED, tokens[0:16])
    for index in (1, 2):
        expected = hash_block_tokens(hashes[index - 1], tokens[16 * index : 16 * index + 16])
        assert hashes[index] == expected
    assert len(set(hashes)) == 3  # equal token blocks at different depths differ


def test_cache_salt_keys_block_zero_and_changes_the_whole_chain() -> None:
    tokens = P3 + [3] * 11
    plain = make_request("a", tokens, 16).block_hashes
    salted = make_request("b", tokens, 16, cache_salt="salt1").block_hashes
    assert salted[0] == hash_block_tokens(None, tokens[0:16], ("salt1",))
    assert salted[1] == hash_block_tokens(salted[0], tokens[16:32], None)
    assert all(a != b for a, b in zip(plain, salted, strict=True))


def test_same_salt_hits_and_other_salt_misses() -> None:
    manager = make_manager(
        11, FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype_bytes=4)
    )
    admit(manager, make_request("r0", P3 + [3] * 11, 16, cache_salt="salt1"))
    same = make_request("r1", P3 + [5] * 5, 16, cache_salt="salt1")
    other = make_request("r2", P3 + [5] * 5, 16, cache_salt="salt2")
    assert manager.get_computed_blocks(same).num_tokens == 48
    assert manager.get_computed_blocks(other).num_tokens == 0


def test_extend_is_incremental() -> None:
    tokens = list(range(40))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens[:20], 8)
    extend_block_hashes(hashes, tokens, 8)
    assert hashes == make_request("r", tokens, 8).block_hashes


def test_hashes_are_identical_across_processes() -> None:
    code = (
        "from scheduler.block_hash import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3], ('s',)).hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == hash_block_tokens(None, [1, 2, 3], ("s",)).hex()


def test_extend_equals_hashing_block_by_block_with_and_without_salt() -> None:
    tokens = list(range(-5, 70))
    for salt in (None, "s"):
        expected: list[bytes] = []
        for index in range(len(tokens) // 8):
            extra = (salt,) if index == 0 and salt is not None else None
            parent = expected[-1] if expected else None
            expected.append(hash_block_tokens(parent, tokens[index * 8 : index * 8 + 8], extra))
        hashes: list[bytes] = []
        for end in (3, 8, 20, 75):
            extend_block_hashes(hashes, tokens[:end], 8, salt)
        assert hashes == expected

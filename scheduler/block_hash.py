"""Chained hashes of full token blocks, the keys of the prefix cache.

`hash_i = H(hash_{i-1} or ROOT, tokens of block i, extra keys of block i)`. A request's hashes
cover only full blocks and grow as tokens are appended. Pure functions; the request keeps the list.

The root is `weights_root(weight_version)`: the engine's weight version is part of every chain, so
a block (device pool, offload tier, transfer, router event) computed under other weights is never
a hit. The initial weights (version None) keep the fixed `SEED`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

BlockHash = bytes
"""16-byte digest of one block and everything before it."""

ExtraKeys = tuple[str, ...]
"""Strings that make a block's identity more specific (cache salt, adapter name)."""

_TOKEN_BYTES = array("q").itemsize
"""Token IDs are hashed as signed 64-bit integers."""

SEED: BlockHash = xxhash.xxh3_128_digest(b"hybridserve-prefix-cache-seed")
"""Parent of block 0: fixed, so hashes are reproducible across processes."""


def weights_root(weight_version: str | None) -> BlockHash:
    """The parent of block 0 for the weights of `weight_version` (None: the weights loaded at
    start-up, whose root is `SEED`)."""
    if weight_version is None:
        return SEED
    return xxhash.xxh3_128_digest(SEED + b"weights:" + weight_version.encode())


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys | None = None,
    root: BlockHash = SEED,
) -> BlockHash:
    """Hash one block of tokens chained to its parent's hash (`root` for block 0)."""
    hasher = xxhash.xxh3_128(parent if parent is not None else root)
    hasher.update(array("q", token_ids).tobytes())
    if extra_keys:
        hasher.update("\x00".join(extra_keys).encode())
    return hasher.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    root: BlockHash = SEED,
) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet (in place).

    The cache salt is an extra key of block 0 only; chaining carries it to every later block.
    Gives exactly `hash_block_tokens` chained block by block, but packs the new tokens once and
    hashes `parent || block bytes` in one call per block (a third faster on long prompts).
    """
    first = len(block_hashes)
    num_full_blocks = len(token_ids) // block_size
    if num_full_blocks <= first:
        return
    parent = block_hashes[-1] if block_hashes else root
    if first == 0 and cache_salt is not None:
        parent = hash_block_tokens(None, token_ids[:block_size], (cache_salt,), root)
        block_hashes.append(parent)
        first = 1
    packed = array("q", token_ids[first * block_size : num_full_blocks * block_size]).tobytes()
    stride = block_size * _TOKEN_BYTES
    digest = xxhash.xxh3_128_digest
    for offset in range(0, len(packed), stride):
        parent = digest(parent + packed[offset : offset + stride])
        block_hashes.append(parent)

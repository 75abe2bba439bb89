"""Why a prefix-cache lookup missed: one reason per group and per stretch of missed tokens.

`KVCacheManager.record_lookup` (admissions) and the replay tool call `explain_misses` after a
lookup. `EvictionHistory` is the pool's bounded memory of evicted keys, so a miss on a block that
was cached and reused for other data reads "evicted" rather than "never seen".

    token 0        group's own hit b     aligned seen a   seen s              target e
       |=== served ===|--- group reason ---|-- not aligned --|--- never seen ---|
  s: the longest prefix of hash blocks some group holds or evicted (tokens the cache knew), a:
  s rounded down to the hit alignment, e: the prompt's hashed tokens before its last one. The
  group reason is the first obstacle of that group's layer type past b; tokens past s were
  never computed for any request (or only under another cache salt).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from scheduler.block_hash import BlockHash, hash_block_tokens
from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.mamba_manager import MambaManager
from scheduler.kv_cache.single_type_manager import SingleTypeManager
from scheduler.kv_cache.window_managers import ChunkedLocalManager, SlidingWindowManager
from scheduler.request import Request


class MissReason(enum.Enum):
    """Why a group could not serve tokens of a prompt it was asked for."""

    EVICTED = "evicted"
    """The block was cached in this group and reused for other data."""
    OUTSIDE_WINDOW = "outside_window"
    """A window or chunk group never kept the block (it fell out of the window first)."""
    NOT_ALIGNED = "not_aligned"
    """The cached run goes on past the hit, but not to the next hit-alignment boundary."""
    MAMBA_CHECKPOINT_MISSING = "mamba_checkpoint_missing"
    """Attention groups know these tokens but no recurrent state was kept at that boundary."""
    SALT = "salt"
    """The same tokens are cached under another cache salt (or none)."""
    NEVER_SEEN = "never_seen"
    """No request computed these tokens (or the cache forgot them long ago)."""


GroupMisses = tuple[tuple[str, int], ...]
"""One group's missed tokens per reason: (reason value, tokens) pairs."""


def explain_misses(
    managers: Sequence[SingleTypeManager],
    pool: BlockPool,
    request: Request,
    group_hit_tokens: Sequence[int],
    alignment: int,
) -> tuple[GroupMisses, ...]:
    """Per group, the tokens of `request`'s lookup it could not serve, by reason."""
    hashes = request.block_hashes
    hash_size = request.hash_block_size
    target = min(request.num_tokens - 1, len(hashes) * hash_size) // hash_size * hash_size
    known = max(  # a chunked-local group "hits" its chunk start without a lookup
        (
            hit
            for manager, hit in zip(managers, group_hit_tokens, strict=True)
            if not isinstance(manager, ChunkedLocalManager)
        ),
        default=0,
    )
    seen = _seen_tokens(pool, hashes, hash_size, known, target)
    seen_aligned = seen // alignment * alignment
    far_reason = MissReason.SALT if _salted_away(pool, request) else MissReason.NEVER_SEEN
    explained = []
    for manager, own_hit in zip(managers, group_hit_tokens, strict=True):
        stretches = [
            (MissReason.NOT_ALIGNED, max(own_hit, seen_aligned), seen),
            (far_reason, max(own_hit, seen), target),
        ]
        if own_hit < seen_aligned:
            reason = _group_reason(manager, pool, hashes, own_hit, seen_aligned)
            stretches.insert(0, (reason, own_hit, seen_aligned))
        misses: dict[str, int] = {}
        for reason, start, stop in stretches:
            if stop > start:
                misses[reason.value] = misses.get(reason.value, 0) + stop - start
        explained.append(tuple(misses.items()))
    return tuple(explained)


def _is_known(pool: BlockPool, block_hash: BlockHash) -> bool:
    return pool.eviction_history.was_evicted_anywhere(block_hash) or any(
        block_hash in hash_map for hash_map in pool.hash_maps
    )


def _seen_tokens(
    pool: BlockPool, hashes: Sequence[BlockHash], hash_size: int, known: int, target: int
) -> int:
    """Tokens from 0 whose hash blocks some group holds or evicted, up to `target`; the first
    `known` tokens are (some group's hit)."""
    count = known // hash_size
    for block_hash in hashes[count : target // hash_size]:
        if not _is_known(pool, block_hash):
            break
        count += 1
    return min(count * hash_size, target)


def _group_reason(
    manager: SingleTypeManager,
    pool: BlockPool,
    hashes: Sequence[BlockHash],
    own_hit: int,
    seen: int,
) -> MissReason:
    """The first obstacle of one group between its own hit and the seen end."""
    hash_map = pool.hash_maps[manager.group_id]
    size = manager.block_size
    if isinstance(manager, MambaManager):
        wanted = [seen // size - 1]
    elif isinstance(manager, SlidingWindowManager):
        wanted = list(range(max(seen // size - manager.num_run_blocks, 0), seen // size))[::-1]
    elif isinstance(manager, ChunkedLocalManager):
        chunk_start = (seen - 1) // manager.chunk_size * manager.chunk_size
        wanted = list(range(max(own_hit, chunk_start) // size, seen // size))
    else:
        wanted = list(range(own_hit // size, seen // size))
    missing = [index for index in wanted if manager.hash_of(hashes, index) not in hash_map]
    if not missing:
        return MissReason.NOT_ALIGNED
    key = manager.hash_of(hashes, missing[0])
    if pool.eviction_history.was_evicted(manager.group_id, key):
        return MissReason.EVICTED
    if isinstance(manager, MambaManager):
        return MissReason.MAMBA_CHECKPOINT_MISSING
    if isinstance(manager, SlidingWindowManager | ChunkedLocalManager):
        return MissReason.OUTSIDE_WINDOW
    if missing[0] > own_hit // size:
        return MissReason.NOT_ALIGNED  # the run went on past the aligned hit
    return MissReason.EVICTED


def _salted_away(pool: BlockPool, request: Request) -> bool:
    """A salted request whose first block is known without its salt."""
    if request.hash_salt is None or request.num_tokens < request.hash_block_size:
        return False
    unsalted = hash_block_tokens(
        None, request.cache_token_ids[: request.hash_block_size], root=request.hash_root
    )
    return _is_known(pool, unsalted)

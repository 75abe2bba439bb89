"""What the KV cache manager hands out: a request's blocks per group, the result of a
prefix-cache lookup, and a snapshot of its counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from scheduler.kv_cache.block_pool import KVCacheBlock
from scheduler.kv_cache.free_block_queue import block_ids
from scheduler.kv_cache.miss_reasons import GroupMisses
from scheduler.kv_cache.offload import OffloadCounters
from scheduler.kv_cache.pressure import GroupPressure


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks per KV cache group (hit blocks, or blocks allocated by one call); read-only."""

    blocks: tuple[list[KVCacheBlock], ...]
    copy_sources: tuple[KVCacheBlock | None, ...] = ()
    """A hit at a fine checkpoint: per group, the block a fresh block appended after `blocks`
    is copied from (None: nothing to append); empty for every other hit."""

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block IDs per group (the null block is 0)."""
        return tuple(map(block_ids, self.blocks))

    @property
    def is_empty(self) -> bool:
        """No block in any group."""
        return not any(self.blocks)

    @classmethod
    def empty(cls, num_groups: int) -> KVCacheBlocks:
        return cls(tuple([] for _ in range(num_groups)))


class CacheHit(NamedTuple):
    """Result of a prefix-cache lookup for a new request."""

    blocks: KVCacheBlocks
    num_tokens: int
    """Hit length: a multiple of every group's block size (of `prefix_match_unit` at a state
    checkpoint), at most the prompt length - 1."""
    junction_tokens: int
    """The longest hit one bucket of equal specs found alone, if longer than `num_tokens`, else
    `num_tokens`: where a prefill chunk should end so that a state lands there (Mamba)."""
    group_hit_tokens: tuple[int, ...]
    """Per group, the hit its own bucket found before the groups agreed; empty when nothing was
    looked up (caching off, or a request that reads no hit)."""
    misses: tuple[GroupMisses, ...] = ()
    """Per group, the tokens it could not serve and why (`MissReason` values), measured against
    the cache the lookup saw; empty until `KVCacheManager.explain_misses` (at admission) and
    when nothing was looked up."""
    num_offloaded_blocks: int = 0
    """Blocks of the hit held in the offload tier: the request waits for their loads."""


@dataclass(frozen=True)
class KVCacheStats:
    """KV cache counters. Prefix-cache and eviction counters are cumulative since construction
    (never reset on read): rates come from differences between two snapshots."""

    usage: float
    """Fraction of the usable blocks held by requests."""
    group_usage: tuple[float, ...]
    """Per group, fraction of the usable blocks its tables hold."""
    num_queries: int
    """Lookups of admitted requests (a resumed request counts again)."""
    query_tokens: tuple[int, ...]
    """Per group, tokens of those requests when looked up."""
    group_hit_tokens: tuple[int, ...]
    """Per group, tokens its own bucket could serve (before reconciliation across groups)."""
    hit_tokens: int
    """Tokens actually served from the cache (the reconciled hits)."""
    num_evictions: int
    """Cached blocks reused for other data."""
    group_miss_tokens: tuple[GroupMisses, ...] = ()
    """Per group, tokens of admitted lookups it could not serve, by `MissReason` value."""
    offload: OffloadCounters | None = None
    """The offload tier's usage and counters (None: no tier)."""
    group_pressure: tuple[GroupPressure, ...] = ()
    """Per group, used / free / reclaimable blocks (`scheduler.kv_cache.pressure`)."""

"""Per-group block bookkeeping shared by every layer type, and the full-attention manager.

One manager per KV cache group; all of them share the `BlockPool`. A request's table is a list
indexed by logical block (token t lives in entry t // block_size); entries that no future query
reads are the null block. The window, chunked-local and Mamba managers live in sibling modules.
"""

from __future__ import annotations

import abc
import math
import sys
from collections.abc import Mapping, Sequence
from itertools import islice

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_cache.spec import KVCacheSpec, cdiv

NEVER = sys.maxsize
"""A token count no request reaches: "this event never happens" in quiet limits."""

NO_BLOCKS: list[KVCacheBlock] = []
"""Shared empty result of allocations that take nothing; callers must not mutate it."""


def lookup_all(
    hash_maps: Sequence[Mapping[BlockHash, KVCacheBlock]], block_hash: BlockHash
) -> list[KVCacheBlock] | None:
    """The block cached under `block_hash` in every map, or None if any map misses."""
    found = []
    for hash_map in hash_maps:
        block = hash_map.get(block_hash)
        if block is None:
            return None
        found.append(block)
    return found


class SingleTypeManager(abc.ABC):
    """Blocks of one KV cache group for every request; the layer type decides hits and skips."""

    def __init__(
        self,
        spec: KVCacheSpec,
        pool: BlockPool,
        group_id: int,
        hash_block_size: int,
        hit_alignment: int | None = None,
        cache_unreachable_blocks: bool = False,
    ) -> None:
        if spec.block_size % hash_block_size:
            raise ValueError(
                f"group {group_id} block size {spec.block_size} is not a multiple of the hash "
                f"block size {hash_block_size}"
            )
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group_id = group_id
        self.hash_ratio = spec.block_size // hash_block_size
        """Hash blocks per block of this group."""
        self.hit_alignment = hit_alignment or spec.block_size
        """Token multiple every prefix hit ends on (the lcm of all groups' block sizes)."""
        self.cache_unreachable_blocks = cache_unreachable_blocks
        """Register every full block, as vLLM does, not only those a hit could use."""
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        """Leading table entries already registered in the prefix cache."""
        self.num_dropped_block: dict[str, int] = {}
        """Leading table entries already nulled (nothing before them is live)."""
        self._reachable: tuple[bool, ...] | None = None
        """`is_reachable` over one period of blocks (see `reachable_indices`); None: not yet."""
        self.read_spec(spec)

    def read_spec(self, spec: KVCacheSpec) -> None:  # noqa: B027 (optional hook)
        """Fields of this manager's own spec type; none unless a subclass reads some."""

    @abc.abstractmethod
    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        """Longest hit of at most `max_length` tokens valid for this type in every group of
        `group_ids` (groups with this manager's spec); one list per group, null-padded so that
        `len(list) * block_size` is the hit length, always a multiple of `alignment`."""

    def limit_blocks(self, block_hashes: Sequence[BlockHash], max_length: int) -> int:
        """Blocks a hit of at most `max_length` tokens can span, given the hashes known."""
        return min(max_length // self.block_size, len(block_hashes) // self.hash_ratio)

    def hash_of(self, block_hashes: Sequence[BlockHash], index: int) -> BlockHash:
        """Key of this group's block `index`: the chained hash of its last hash block."""
        return block_hashes[index * self.hash_ratio + self.hash_ratio - 1]

    def block_keys(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> Sequence[BlockHash]:
        """`hash_of` blocks 0 .. num_blocks - 1, in one slice (lookups scan many blocks)."""
        ratio = self.hash_ratio
        return block_hashes[ratio - 1 : num_blocks * ratio : ratio]

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future query of the request reads (0: all stay visible)."""
        return 0

    def min_computed_for_skip(self, num_skipped_tokens: int) -> int:
        """Smallest computed-token count whose skipped tokens reach `num_skipped_tokens`."""
        return NEVER

    def remove_skipped_blocks(self, req_id: str, total_computed: int) -> None:
        """Null and free the request's blocks whose tokens are all skipped (highest first)."""
        freed = self.take_skipped_blocks(req_id, total_computed)
        if freed:
            self.pool.free_blocks(freed)

    def take_skipped_blocks(self, req_id: str, total_computed: int) -> list[KVCacheBlock]:
        """Null the request's entries whose tokens are all skipped; return what they held,
        highest first, for the caller to free (null entries included: freeing skips them)."""
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return NO_BLOCKS
        start = self.num_dropped_block[req_id]
        stop = min(self.get_num_skipped_tokens(total_computed) // self.block_size, len(blocks))
        if stop <= start:
            return NO_BLOCKS
        freed = blocks[start:stop]
        freed.reverse()
        blocks[start:stop] = [self.pool.null_block] * (stop - start)
        self.num_dropped_block[req_id] = stop
        return freed

    def get_num_blocks_to_allocate(
        self,
        req_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed: int,
    ) -> int:
        """Free blocks this allocation consumes, reviving evictable hit blocks included."""
        blocks = self.req_to_blocks.get(req_id)
        if blocks is not None:
            return self._num_fresh_blocks(cdiv(num_tokens, self.block_size), len(blocks))
        skipped = self.get_num_skipped_tokens(total_computed) // self.block_size
        held = max(skipped, len(new_computed_blocks))
        count = self._num_fresh_blocks(cdiv(num_tokens, self.block_size), held)
        null = self.pool.null_block
        for block in islice(new_computed_blocks, skipped, None):
            if block.ref_cnt == 0 and block is not null:
                count += 1
        return count

    def _num_fresh_blocks(self, num_entries: int, num_held: int) -> int:
        """Fresh blocks needed to grow a table of `num_held` entries to `num_entries`."""
        return max(num_entries - num_held, 0)

    def allocate_new_computed_blocks(
        self, req_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed: int
    ) -> None:
        """Adopt a prefix hit as the start of a new request's table (skipped blocks untouched)."""
        assert req_id not in self.req_to_blocks, f"{req_id} already holds blocks"
        skipped = self.get_num_skipped_tokens(num_local_computed) // self.block_size
        table = [self.pool.null_block] * skipped + list(new_computed_blocks[skipped:])
        self.pool.adopt_hit(table, skipped, req_id)
        self.req_to_blocks[req_id] = table
        self.num_cached_block[req_id] = len(table)
        self.num_dropped_block[req_id] = skipped

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the table to cover `num_tokens`; return the entries appended (what a worker
        appends to its copy of the table)."""
        missing = self.num_missing_blocks(req_id, num_tokens)
        if missing <= 0:
            return NO_BLOCKS
        return self.append_blocks(req_id, self.pool.get_new_blocks(missing, self.group_id))

    def num_missing_blocks(self, req_id: str, num_tokens: int) -> int:
        """Fresh blocks the table lacks to cover `num_tokens` (<= 0: none); a request without
        a table gets an empty one."""
        return cdiv(num_tokens, self.block_size) - len(self._table(req_id))

    def append_blocks(self, req_id: str, new_blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Append blocks just taken from the pool to the request's table; return them."""
        self.req_to_blocks[req_id].extend(new_blocks)
        return new_blocks

    def _table(self, req_id: str) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            blocks = self.req_to_blocks[req_id] = []
            self.num_cached_block[req_id] = 0
            self.num_dropped_block[req_id] = 0
        return blocks

    def is_reachable(self, index: int) -> bool:
        """Whether some prefix hit could use block `index` (only those are registered: an
        unreachable cached block would only push out blocks a hit could use)."""
        return True

    def cache_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Register the request's full, reachable blocks among its first `num_tokens` tokens."""
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block[req_id]
        if num_full <= num_cached:
            return
        self.pool.cache_full_blocks(
            block_hashes,
            self.req_to_blocks[req_id],
            self.reachable_indices(num_cached, num_full),
            self.group_id,
            self.hash_ratio,
        )
        self.num_cached_block[req_id] = num_full

    def reachable_indices(self, start: int, stop: int) -> Sequence[int]:
        """The block indices in [start, stop) worth registering: all of them when unreachable
        blocks are cached too, else those `is_reachable` keeps. Reachability repeats every
        `reachability_period_tokens` tokens, so it is read from one period's pattern (computed
        once) rather than asked block by block."""
        if self.cache_unreachable_blocks:
            return range(start, stop)
        pattern = self._reachable
        if pattern is None:
            period = self.reachability_period_tokens() // self.block_size
            pattern = self._reachable = tuple(self.is_reachable(i) for i in range(period))
        if all(pattern):
            return range(start, stop)
        period = len(pattern)
        return [index for index in range(start, stop) if pattern[index % period]]

    def reachability_period_tokens(self) -> int:
        """Tokens after which `is_reachable` repeats (a multiple of the block size)."""
        return math.lcm(self.block_size, self.hit_alignment)

    def first_aligned_end(self, index: int) -> int:
        """The first token count a hit may end on that covers block `index` whole."""
        return cdiv((index + 1) * self.block_size, self.hit_alignment) * self.hit_alignment

    def pop_blocks(self, req_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks tail first, for the caller to free."""
        self.num_cached_block.pop(req_id, None)
        self.num_dropped_block.pop(req_id, None)
        blocks = self.req_to_blocks.pop(req_id, None)
        return blocks[::-1] if blocks else NO_BLOCKS

    def quiet_limits(self, req_id: str, caching: bool) -> tuple[int, int, int]:
        """(slots, computed, cached) below which a step of this request changes nothing here:
        needing at most `slots` slots allocates nothing, fewer than `computed` computed tokens
        frees nothing, caching fewer than `cached` tokens registers nothing."""
        blocks = self.req_to_blocks.get(req_id, NO_BLOCKS)
        slots = len(blocks) * self.block_size
        next_drop = (self.num_dropped_block.get(req_id, 0) + 1) * self.block_size
        computed = self.min_computed_for_skip(next_drop)
        cached = (self.num_cached_block.get(req_id, 0) + 1) * self.block_size if caching else NEVER
        return slots, computed, cached

    def get_num_common_prefix_blocks(self, req_id: str, num_running_requests: int) -> int:
        """Leading blocks every running request shares (cascade attention); 0 unless full."""
        return 0


class FullAttentionManager(SingleTypeManager):
    """Full causal attention: every block stays; hits are downward closed."""

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        keys = self.block_keys(block_hashes, self.limit_blocks(block_hashes, max_length))
        maps = [self.pool.lookup_maps[group_id] for group_id in group_ids]
        if len(maps) == 1:
            hash_map = maps[0]
            hits: list[KVCacheBlock] = []
            for block_hash in keys:
                block = hash_map.get(block_hash)
                if block is None:
                    break
                hits.append(block)
            per_group = [hits]
        else:
            per_group = [[] for _ in group_ids]
            for block_hash in keys:
                found = lookup_all(maps, block_hash)
                if found is None:
                    break
                for hits, block in zip(per_group, found, strict=True):
                    hits.append(block)
        num_aligned = len(per_group[0]) * self.block_size // alignment * alignment
        for hits in per_group:
            del hits[num_aligned // self.block_size :]
        return per_group

    def get_num_common_prefix_blocks(self, req_id: str, num_running_requests: int) -> int:
        count = 0
        for block in self.req_to_blocks.get(req_id, NO_BLOCKS):
            if block.ref_cnt != num_running_requests:
                break
            count += 1
        return count

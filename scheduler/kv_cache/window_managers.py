"""Managers of the attention types that forget old tokens: sliding window and chunked local.

Both null the table entries of blocks no future query reads, so a request holds a bounded number
of real blocks; their prefix-cache hits need only the blocks a recomputed token still attends to.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.block_pool import KVCacheBlock
from scheduler.kv_cache.single_type_manager import SingleTypeManager, lookup_all
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)


class SlidingWindowManager(SingleTypeManager):
    """Sliding window w: the query at position p reads keys in (p - w, p]."""

    def read_spec(self, spec: KVCacheSpec) -> None:
        assert isinstance(spec, SlidingWindowSpec), spec
        self.sliding_window = spec.sliding_window
        self.num_run_blocks = cdiv(spec.sliding_window - 1, spec.block_size)
        """Cached blocks a hit must end with: the first recomputed token reads the w - 1
        tokens before it, which fill exactly this many whole blocks before an aligned end."""

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        """Scanning right to left, the first run of `num_run_blocks` cached blocks with an
        aligned end fixes the hit; a shorter run that reaches block 0 counts too."""
        limit = self.limit_blocks(block_hashes, max_length)
        null = self.pool.null_block
        if self.num_run_blocks == 0:
            num_aligned = limit * self.block_size // alignment * alignment
            return [[null] * (num_aligned // self.block_size) for _ in group_ids]
        maps = [self.pool.lookup_maps[group_id] for group_id in group_ids]
        keys = self.block_keys(block_hashes, limit)
        run: list[list[KVCacheBlock]] = []
        """The current run's blocks per index (each a list over the groups), right to left."""
        for index in range(limit - 1, -1, -1):
            found = lookup_all(maps, keys[index])
            if found is None:
                run.clear()
                continue
            if not run and (index + 1) * self.block_size % alignment:
                continue  # a hit cannot end here
            run.append(found)
            if len(run) >= self.num_run_blocks:
                return _hit_per_group(null, index, run, len(group_ids))
        # Only a run touching block 0 is left (it began at an aligned end, so it is aligned).
        return _hit_per_group(null, 0, run, len(group_ids))

    def is_reachable(self, index: int) -> bool:
        """A hit ending at e reads the `num_run_blocks` blocks before e: block `index` is used
        only if an aligned end lies within that many blocks after it."""
        return self.first_aligned_end(index) <= (index + self.num_run_blocks) * self.block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def min_computed_for_skip(self, num_skipped_tokens: int) -> int:
        return num_skipped_tokens + self.sliding_window - 1


def _hit_per_group(
    null: KVCacheBlock, first: int, run: list[list[KVCacheBlock]], num_groups: int
) -> list[list[KVCacheBlock]]:
    """Per group: null entries before block `first`, then the run's blocks (`run` holds them
    right to left, one list over the groups per block)."""
    run.reverse()
    columns = zip(*run, strict=True) if run else [()] * num_groups
    return [[null] * first + list(blocks) for blocks in columns]


class ChunkedLocalManager(SingleTypeManager):
    """Chunked local attention C: the query at p reads keys in [floor(p / C) * C, p]."""

    def read_spec(self, spec: KVCacheSpec) -> None:
        assert isinstance(spec, ChunkedLocalAttentionSpec), spec
        if spec.attention_chunk_size % spec.block_size:
            # Otherwise a hit could end inside a chunk whose first block is not looked up.
            raise ValueError(
                f"group {self.group_id}: attention chunk size {spec.attention_chunk_size} must "
                f"be a multiple of the block size {spec.block_size}; choose a block_size that "
                f"divides {spec.attention_chunk_size}"
            )
        self.chunk_size = spec.attention_chunk_size

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        """Blocks of chunks before the one holding position `max_length` count as hit with no
        lookup (no later token reads them); inside that chunk, cached blocks left to right."""
        assert alignment == self.block_size, "chunked local hits must align to their block size"
        start = (max_length // self.chunk_size) * self.chunk_size // self.block_size
        limit = self.limit_blocks(block_hashes, max_length)
        maps = [self.pool.lookup_maps[group_id] for group_id in group_ids]
        per_group = [[self.pool.null_block] * start for _ in group_ids]
        for index in range(start, limit):
            found = lookup_all(maps, self.hash_of(block_hashes, index))
            if found is None:
                break
            for hits, block in zip(per_group, found, strict=True):
                hits.append(block)
        return per_group

    def is_reachable(self, index: int) -> bool:
        """A hit ending at e reads only the blocks of e's own chunk, and a hit ending on a chunk
        end reads none of that chunk: block `index` is used only if an aligned end falls after
        it and before its chunk ends (never, for a chunk's last block)."""
        chunk_end = ((index * self.block_size) // self.chunk_size + 1) * self.chunk_size
        return self.first_aligned_end(index) < chunk_end

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return (num_computed_tokens // self.chunk_size) * self.chunk_size

    def reachability_period_tokens(self) -> int:
        return math.lcm(self.block_size, self.hit_alignment, self.chunk_size)

    def min_computed_for_skip(self, num_skipped_tokens: int) -> int:
        return cdiv(num_skipped_tokens, self.chunk_size) * self.chunk_size

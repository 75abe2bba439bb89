"""Manager of recurrent-state (Mamba-style) groups: one block holds the state after its last token.

Modes (`MambaCacheMode`):
  ALL    a block per table entry, like attention; the kernel writes the state at every block end.
  ALIGN  only the running-state entry is a real block, earlier entries are null; prefill is split
         at block boundaries by the scheduler so each chunk's final state lands at a block end.
  NONE   one state block per request for its whole life; no prefix caching.
In ALL and ALIGN only the latest state matters: once the next step starts, every block wholly
before the last computed token is freed (it keeps its hash and stays hit-able until evicted).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.block_pool import KVCacheBlock
from scheduler.kv_cache.single_type_manager import NEVER, NO_BLOCKS, SingleTypeManager, lookup_all
from scheduler.kv_cache.spec import KVCacheSpec, MambaCacheMode, MambaSpec, cdiv


class MambaManager(SingleTypeManager):
    """State blocks of one Mamba group; see the module docstring for the three modes."""

    def read_spec(self, spec: KVCacheSpec) -> None:
        assert isinstance(spec, MambaSpec), spec
        self.mode = spec.mamba_cache_mode

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        alignment: int,
    ) -> list[list[KVCacheBlock]]:
        """The last cached state at an aligned block end, scanning right to left."""
        if self.mode is MambaCacheMode.NONE:
            return [[] for _ in group_ids]
        maps = [self.pool.lookup_maps[group_id] for group_id in group_ids]
        null = self.pool.null_block
        for index in range(self.limit_blocks(block_hashes, max_length) - 1, -1, -1):
            if (index + 1) * self.block_size % alignment:
                continue
            found = lookup_all(maps, self.hash_of(block_hashes, index))
            if found is not None:
                return [[null] * index + [block] for block in found]
        return [[] for _ in group_ids]

    def is_reachable(self, index: int) -> bool:
        """A hit restores the state at its aligned end: only states there can be used."""
        return (index + 1) * self.block_size % self.hit_alignment == 0

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        if self.mode is MambaCacheMode.NONE:
            return 0
        return max(0, num_computed_tokens - 1)

    def min_computed_for_skip(self, num_skipped_tokens: int) -> int:
        if self.mode is MambaCacheMode.NONE:
            return NEVER
        return num_skipped_tokens + 1

    def _num_fresh_blocks(self, num_entries: int, num_held: int) -> int:
        if self.mode is MambaCacheMode.ALL:
            return max(num_entries - num_held, 0)
        if self.mode is MambaCacheMode.ALIGN:
            return 1 if num_entries > num_held else 0
        return 0 if num_held else 1

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        if self.mode is MambaCacheMode.ALL:
            return super().allocate_new_blocks(req_id, num_tokens)
        blocks = self._table(req_id)
        if self.mode is MambaCacheMode.NONE:
            if blocks:
                return NO_BLOCKS
            new_blocks = self.pool.get_new_blocks(1, self.group_id)
            blocks.extend(new_blocks)
            return new_blocks
        num_held = len(blocks)
        missing = cdiv(num_tokens, self.block_size) - num_held
        if missing <= 0:
            return NO_BLOCKS
        blocks.extend([self.pool.null_block] * (missing - 1))
        blocks.extend(self.pool.get_new_blocks(1, self.group_id))
        # The null padding is part of the delta: workers append it to keep table indices right.
        return blocks[num_held:]

    def cache_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """ALL: every full block (the kernel writes a state at each block end). ALIGN: only a
        block ending exactly at `num_tokens`, the end of this step; a block the step runs past
        keeps the state of an earlier token (a prompt's tail can be computed in several steps
        when a larger block size sets the split). NONE: nothing."""
        if self.mode is MambaCacheMode.ALL:
            super().cache_blocks(req_id, block_hashes, num_tokens)
            return
        num_full = num_tokens // self.block_size
        if self.mode is MambaCacheMode.NONE or num_full <= self.num_cached_block[req_id]:
            return
        reachable = self.cache_unreachable_blocks or self.is_reachable(num_full - 1)
        if num_tokens % self.block_size == 0 and reachable:
            blocks = self.req_to_blocks[req_id]
            last = range(num_full - 1, num_full)
            self.pool.cache_full_blocks(block_hashes, blocks, last, self.group_id, self.hash_ratio)
        self.num_cached_block[req_id] = num_full

    def quiet_limits(self, req_id: str, caching: bool) -> tuple[int, int, int]:
        if self.mode is MambaCacheMode.NONE:
            return (NEVER if self.req_to_blocks.get(req_id) else 0), NEVER, NEVER
        return super().quiet_limits(req_id, caching)

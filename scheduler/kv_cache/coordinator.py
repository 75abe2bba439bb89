"""KV cache coordinators: fan a request's operations out to one manager per KV cache group, and
reconcile the prefix-cache hit across groups.

  NoPrefixCacheCoordinator  caching off; any number of groups (0 included); hits are always 0.
  UnitaryCoordinator        one bucket: one group, or several groups with equal specs.
  HybridCoordinator         several buckets: a fixed point on the hit length (full attention first).
A bucket is the set of groups with equal specs; they are looked up together (all must hit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_cache.mamba_manager import MambaManager
from scheduler.kv_cache.single_type_manager import (
    NEVER,
    NO_BLOCKS,
    FullAttentionManager,
    SingleTypeManager,
)
from scheduler.kv_cache.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    manager_spec,
)
from scheduler.kv_cache.window_managers import ChunkedLocalManager, SlidingWindowManager

GroupBlocks = tuple[list[KVCacheBlock], ...]
"""One block list per KV cache group."""


class CoordinatorHit(NamedTuple):
    """A reconciled prefix-cache hit."""

    blocks: GroupBlocks
    num_tokens: int
    group_hit_tokens: tuple[int, ...]
    """Per group, the longest hit its bucket found on any pass (before reconciliation)."""


class Bucket(NamedTuple):
    """Groups with equal specs, looked up together through the first one's manager."""

    manager: SingleTypeManager
    group_ids: tuple[int, ...]
    is_full: bool


def make_manager(
    spec: KVCacheSpec,
    pool: BlockPool,
    group_id: int,
    hash_block_size: int,
    hit_alignment: int | None = None,
    cache_unreachable_blocks: bool = False,
) -> SingleTypeManager:
    """The manager for one group's spec (a uniform-type group is managed as its members)."""
    spec = manager_spec(spec)
    args = (pool, group_id, hash_block_size, hit_alignment, cache_unreachable_blocks)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(spec, *args)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, *args)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalManager(spec, *args)
    if isinstance(spec, MambaSpec):
        return MambaManager(spec, *args)
    raise ValueError(f"no KV cache manager for spec type {type(spec).__name__}")


class KVCacheCoordinator:
    """Operations over every group of a request; subclasses decide how hits are found."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        pool: BlockPool,
        hash_block_size: int,
        cache_unreachable_blocks: bool = False,
    ) -> None:
        self.pool = pool
        self.alignment = math.lcm(*(group.spec.block_size for group in groups)) if groups else 1
        """Token multiple every prefix hit ends on: the lcm of the group block sizes."""
        self.managers = [
            make_manager(
                group.spec,
                pool,
                group_id,
                hash_block_size,
                self.alignment,
                cache_unreachable_blocks,
            )
            for group_id, group in enumerate(groups)
        ]
        self.num_groups = len(self.managers)
        self.group_specs = tuple(group.spec for group in groups)
        self._equal_block_sizes = len({manager.block_size for manager in self.managers}) <= 1
        self._has_state_groups = any(isinstance(m, MambaManager) for m in self.managers)
        self._nothing_new: GroupBlocks = tuple(NO_BLOCKS for _ in self.managers)
        self._extra_slots = [0] * self.num_groups
        """Per group: slots past each allocation's tokens (a drafter's lookahead)."""
        self._max_slots = 0

    def set_drafter_lookahead(self, num_tokens: int, max_model_len: int) -> None:
        """Give the drafter's groups `num_tokens` slots past every allocation (up to
        `max_model_len`): its drafts' KV is written there. The target's groups get none, nor
        do the drafter's state groups (its draft steps run on copies of their states)."""
        self._extra_slots = [
            num_tokens if spec.drafter and not isinstance(manager, MambaManager) else 0
            for spec, manager in zip(self.group_specs, self.managers, strict=True)
        ]
        self._max_slots = max_model_len

    def _slots(self, group_id: int, num_tokens: int) -> int:
        extra = self._extra_slots[group_id]
        return min(num_tokens + extra, self._max_slots) if extra else num_tokens

    def _group_slots(self, num_tokens: int) -> list[int]:
        """`_slots` of every group, in group order."""
        if not self._max_slots:  # no drafter lookahead: every group gets `num_tokens`
            return [num_tokens] * self.num_groups
        return [self._slots(group_id, num_tokens) for group_id in range(self.num_groups)]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> CoordinatorHit:
        """No caching: nothing is ever hit."""
        return CoordinatorHit(tuple([] for _ in self.managers), 0, (0,) * self.num_groups)

    def get_num_blocks_to_allocate(
        self,
        req_id: str,
        num_tokens: int,
        new_computed_blocks: GroupBlocks | None,
        total_computed: int,
    ) -> int:
        """Free blocks an allocation to `num_tokens` slots consumes, over all groups."""
        return sum(
            self.get_num_blocks_per_group(req_id, num_tokens, new_computed_blocks, total_computed)
        )

    def get_num_blocks_per_group(
        self,
        req_id: str,
        num_tokens: int,
        new_computed_blocks: GroupBlocks | None,
        total_computed: int,
    ) -> list[int]:
        """`get_num_blocks_to_allocate` group by group, in group order."""
        if new_computed_blocks is None:
            new_computed_blocks = self._nothing_new
        return [
            manager.get_num_blocks_to_allocate(req_id, slots, hits, total_computed)
            for manager, slots, hits in zip(
                self.managers, self._group_slots(num_tokens), new_computed_blocks, strict=True
            )
        ]

    def allocate_new_computed_blocks(
        self, req_id: str, new_computed_blocks: GroupBlocks | None, num_local_computed: int
    ) -> None:
        """Start a new request's tables from its hit (every group touched before any pops)."""
        for group_id, manager in enumerate(self.managers):
            hits = new_computed_blocks[group_id] if new_computed_blocks is not None else []
            manager.allocate_new_computed_blocks(req_id, hits, num_local_computed)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> GroupBlocks:
        """Grow every group's table to `num_tokens` slots, in group order: one pool pop for
        all groups, unless a Mamba group's table grows by its own rule (then one per group)."""
        managers = self.managers
        if self._has_state_groups:
            return tuple(
                manager.allocate_new_blocks(req_id, self._slots(gid, num_tokens))
                for gid, manager in enumerate(managers)
            )
        counts = [
            max(manager.num_missing_blocks(req_id, slots), 0)
            for manager, slots in zip(managers, self._group_slots(num_tokens), strict=True)
        ]
        if not any(counts):
            return self._nothing_new
        per_group = self.pool.get_new_blocks_per_group(counts)
        return tuple(
            manager.append_blocks(req_id, blocks)
            for manager, blocks in zip(managers, per_group, strict=True)
        )

    def cache_blocks(self, req_id: str, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Register full blocks of the first `num_tokens` tokens in every group."""
        for manager in self.managers:
            manager.cache_blocks(req_id, block_hashes, num_tokens)

    def remove_skipped_blocks(self, req_id: str, total_computed: int) -> None:
        """Free every group's blocks that no future query reads (one release for all groups,
        as one per group in turn)."""
        per_group = [
            manager.take_skipped_blocks(req_id, total_computed) for manager in self.managers
        ]
        if any(per_group):
            self.pool.free_blocks_per_group(per_group)

    def free(self, req_id: str, block_hashes: Sequence[BlockHash] = ()) -> None:
        """Free the request's blocks: LRU, group by group, each group's table tail first; the
        `chain` policy, as one chain from its last token to its first over every group."""
        per_group = [manager.pop_blocks(req_id) for manager in self.managers]
        if self.pool.chains is None:
            self.pool.free_blocks([block for blocks in per_group for block in blocks])
            return
        self.pool.free_chain(self._chain_order(per_group), block_hashes)

    def _chain_order(self, per_group: list[list[KVCacheBlock]]) -> list[KVCacheBlock]:
        """The groups' blocks (each list tail first) by token position, last first, ties in
        group order (a stable sort by position)."""
        if self._equal_block_sizes and len(set(map(len, per_group))) <= 1:
            # Every list covers the same positions: its entries i, group after group.
            return [
                block for same_position in zip(*per_group, strict=True) for block in same_position
            ]
        merged: list[KVCacheBlock] = []
        positions: list[int] = []  # no (position, block) tuples: they would wake the GC
        for manager, blocks in zip(self.managers, per_group, strict=True):
            size = manager.block_size  # `blocks` is tail first: positions count down
            merged.extend(blocks)
            positions.extend(range((len(blocks) - 1) * size, -1, -size))
        order = sorted(range(len(merged)), key=positions.__getitem__, reverse=True)  # stable
        return [merged[index] for index in order]

    def uncache_from(self, req_id: str, num_tokens: int) -> None:
        """Drop the prefix-cache keys of the request's blocks not wholly within `num_tokens`."""
        null = self.pool.null_block
        for manager in self.managers:
            blocks = manager.req_to_blocks.get(req_id, [])
            first = num_tokens // manager.block_size
            self.pool.evict_blocks(b.block_id for b in blocks[first:] if b is not null)

    def get_blocks(self, req_id: str) -> GroupBlocks:
        """The request's current tables (live lists: do not mutate)."""
        return tuple(manager.req_to_blocks.get(req_id, []) for manager in self.managers)

    def get_num_common_prefix_blocks(
        self, req_id: str, num_running_requests: int
    ) -> tuple[int, ...]:
        """Per group, leading blocks shared by all running requests."""
        return tuple(
            manager.get_num_common_prefix_blocks(req_id, num_running_requests)
            for manager in self.managers
        )

    def quiet_limits(self, req_id: str, caching: bool) -> tuple[int, int, int]:
        """Element-wise minimum of every manager's quiet limits."""
        slots = computed = cached = NEVER
        for manager in self.managers:
            group_slots, group_computed, group_cached = manager.quiet_limits(req_id, caching)
            if group_slots < slots:
                slots = group_slots
            if group_computed < computed:
                computed = group_computed
            if group_cached < cached:
                cached = group_cached
        return slots, computed, cached

    def check_invariants(self, held: Sequence[KVCacheBlock] = ()) -> None:
        """Ref count = number of requests listing the block (plus one for each of `held`,
        blocks taken outside any table), and each block in one group only."""
        listed: dict[int, int] = {block.block_id: 1 for block in held}
        null = self.pool.null_block
        for manager in self.managers:
            for req_id, blocks in manager.req_to_blocks.items():
                real = [block for block in blocks if block is not null]
                assert len({block.block_id for block in real}) == len(real), req_id
                for block in real:
                    assert block.group_id == manager.group_id, (req_id, block)
                    listed[block.block_id] = listed.get(block.block_id, 0) + 1
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == listed.get(block.block_id, 0), block
        self.pool.check_invariants()


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Caching off: allocation and freeing only."""


def make_buckets(
    managers: Sequence[SingleTypeManager], group_specs: Sequence[KVCacheSpec]
) -> list[Bucket]:
    """Group managers by equal group spec (first-seen order), full-attention buckets first."""
    by_spec: dict[KVCacheSpec, list[SingleTypeManager]] = {}
    for manager, spec in zip(managers, group_specs, strict=True):
        by_spec.setdefault(spec, []).append(manager)
    buckets = [
        Bucket(
            members[0],
            tuple(member.group_id for member in members),
            isinstance(members[0], FullAttentionManager),
        )
        for members in by_spec.values()
    ]
    return sorted(buckets, key=lambda bucket: not bucket.is_full)


class UnitaryCoordinator(KVCacheCoordinator):
    """One bucket: its own finder, aligned to its block size."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        pool: BlockPool,
        hash_block_size: int,
        cache_unreachable_blocks: bool = False,
    ) -> None:
        super().__init__(groups, pool, hash_block_size, cache_unreachable_blocks)
        (self.bucket,) = make_buckets(self.managers, self.group_specs)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> CoordinatorHit:
        manager = self.bucket.manager
        hits = manager.find_longest_cache_hit(
            block_hashes, max_length, self.bucket.group_ids, manager.block_size
        )
        num_tokens = len(hits[0]) * manager.block_size
        return CoordinatorHit(tuple(hits), num_tokens, (num_tokens,) * self.num_groups)


class HybridCoordinator(KVCacheCoordinator):
    """Several buckets: shrink the candidate until every bucket accepts it (a fixed point)."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        pool: BlockPool,
        hash_block_size: int,
        cache_unreachable_blocks: bool = False,
    ) -> None:
        super().__init__(groups, pool, hash_block_size, cache_unreachable_blocks)
        self.buckets = make_buckets(self.managers, self.group_specs)
        for bucket in self.buckets:
            if isinstance(bucket.manager, ChunkedLocalManager) and (
                bucket.manager.block_size != self.alignment
            ):
                raise ValueError(
                    f"chunked local attention group block size {bucket.manager.block_size} must "
                    f"equal the hit alignment {self.alignment} (lcm of the group block sizes)"
                )

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> CoordinatorHit:
        """Full-attention buckets first (downward closed: looked up once, then trimmed); every
        other bucket is re-queried each pass, unless its last query had the same candidate,
        until a whole pass leaves the candidate unchanged. Every full-attention group's list is
        finally truncated to the reconciled length."""
        lists: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        best = [0] * self.num_groups
        queried: list[int | None] = [None] * len(self.buckets)
        """Per bucket, the candidate of its last lookup (its lists hold that answer)."""
        hit = max_length
        while True:
            candidate = hit
            for index, bucket in enumerate(self.buckets):
                block_size = bucket.manager.block_size
                if bucket.is_full and queried[index] is not None:
                    candidate = candidate // block_size * block_size
                elif queried[index] == candidate:
                    candidate = len(lists[bucket.group_ids[0]]) * block_size
                else:
                    queried[index] = candidate
                    found = bucket.manager.find_longest_cache_hit(
                        block_hashes, candidate, bucket.group_ids, self.alignment
                    )
                    candidate = len(found[0]) * block_size
                    for group_id, blocks in zip(bucket.group_ids, found, strict=True):
                        lists[group_id] = blocks
                        best[group_id] = max(best[group_id], candidate)
            if candidate >= hit:
                break
            hit = candidate
        for bucket in self.buckets:
            if bucket.is_full:
                for group_id in bucket.group_ids:
                    del lists[group_id][hit // bucket.manager.block_size :]
        return CoordinatorHit(tuple(lists), hit, tuple(best))


def make_coordinator(
    groups: Sequence[KVCacheGroupSpec],
    pool: BlockPool,
    hash_block_size: int,
    enable_caching: bool,
    cache_unreachable_blocks: bool = False,
) -> KVCacheCoordinator:
    """The coordinator for these groups: no caching, one bucket, or hybrid."""
    if not enable_caching or not groups:
        # Nothing is hashed: any common divisor of the block sizes will do.
        return NoPrefixCacheCoordinator(
            groups, pool, math.gcd(*(g.spec.block_size for g in groups))
        )
    if len({group.spec for group in groups}) == 1:
        return UnitaryCoordinator(groups, pool, hash_block_size, cache_unreachable_blocks)
    return HybridCoordinator(groups, pool, hash_block_size, cache_unreachable_blocks)

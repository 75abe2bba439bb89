"""The KV cache facade the scheduler calls: prefix-cache lookup, slot allocation, freeing, stats.

Layering: `KVCacheManager` -> one coordinator (no caching / unitary / hybrid) -> one manager per
KV cache group -> one shared `BlockPool`. Block lists are always one per group, in group order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import ClassVar

from scheduler.config import OffloadConfig
from scheduler.kv_cache.block_pool import BlockPool
from scheduler.kv_cache.checkpoints import StateCheckpoints
from scheduler.kv_cache.coordinator import make_coordinator
from scheduler.kv_cache.events import OUTLOOK_BLOCKS, EvictionOutlook, KVEventBatch, KVEventSink
from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.free_block_queue import block_ids
from scheduler.kv_cache.mamba_manager import MambaManager
from scheduler.kv_cache.manager_types import CacheHit, KVCacheBlocks, KVCacheStats
from scheduler.kv_cache.miss_reasons import explain_misses
from scheduler.kv_cache.offload import build_offload_index, count_offloaded
from scheduler.kv_cache.outlook import pool_eviction_outlook
from scheduler.kv_cache.pressure import group_pressure
from scheduler.kv_cache.spec import KVCacheConfig, MambaCacheMode, MambaSpec, manager_spec
from scheduler.kv_cache.spec_slots import SpecStateSlots
from scheduler.kv_cache.step_phases import ALL_PHASES, StepPhases, step_phases
from scheduler.kv_cache.window_managers import ChunkedLocalManager, SlidingWindowManager
from scheduler.output import BlockCopy, OffloadOps, StateSave
from scheduler.request import Request

logger = logging.getLogger(__name__)

__all__ = ["CacheHit", "KVCacheBlocks", "KVCacheManager", "KVCacheStats"]


class KVCacheManager:
    """Prefix caching and block allocation for every KV cache group of one model."""

    _use_quiet_path: ClassVar[bool] = True
    """Skip steps that provably change nothing (decode between block boundaries)."""

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        max_model_len: int,
        enable_caching: bool = True,
        cache_unreachable_blocks: bool = False,
        eviction: EvictionPolicy = EvictionPolicy.CHAIN,
        prefix_match_unit: int | None = None,
    ) -> None:
        """`cache_unreachable_blocks` registers every full block as vLLM does, also those no
        prefix hit can use (a block a sliding window or chunk never reads at an aligned end);
        by default they stay unregistered and go back to the front of the free queue.
        `eviction` picks which cached blocks are reused first (`EvictionPolicy`).
        `prefix_match_unit` (tokens), finer than the hit alignment of a model with recurrent
        state groups, adds state checkpoints on that grid (`scheduler.kv_cache.checkpoints`)."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        sizes = config.block_sizes
        self.num_groups = len(sizes)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching and self.num_groups > 0
        self.alignment_tokens = math.lcm(*sizes) if sizes else max_model_len
        """Hit lengths and block-aligned prefill chunks are multiples of this (lcm)."""
        self._hash_block_size = math.gcd(*sizes) if self.enable_caching else self.alignment_tokens
        self.pool = BlockPool(config.num_blocks, self.num_groups, eviction)
        self.coordinator = make_coordinator(
            config.groups,
            self.pool,
            self._hash_block_size,
            self.enable_caching,
            cache_unreachable_blocks,
        )
        self.checkpoints = StateCheckpoints.create(
            self.coordinator.managers, self.pool, prefix_match_unit or None, self.enable_caching
        )
        """Fine-grained hits of recurrent-state models (None: hits on the block grid only)."""
        if self.checkpoints is not None:
            logger.info(self.checkpoints.describe())
        self.spec_slots: SpecStateSlots | None = None
        """Draft-position states of recurrent groups (None: no speculation or no such group)."""
        self.draft_lookahead = 0
        """Slots the drafter's groups get past each allocation's tokens, where a drafter model
        writes the KV of its drafts (`enable_spec_slots`)."""
        self.needs_block_aligned_prefill = self.enable_caching and any(
            isinstance(spec, MambaSpec) and spec.mamba_cache_mode is MambaCacheMode.ALIGN
            for spec in (manager_spec(group.spec) for group in config.groups)
        )
        """Prefill must end chunks at block boundaries (a Mamba group keeps states only at
        chunk ends); see `scheduler.prefill_split`."""
        self.has_windowed_groups = not self.needs_block_aligned_prefill and any(
            isinstance(manager, ChunkedLocalManager | SlidingWindowManager)
            for manager in self.coordinator.managers
        )
        """Some group frees a request's old blocks as it advances (sliding window, chunked
        local): a prompt computed in chunks holds fewer blocks than computed at once."""
        self._quiet: dict[str, tuple[int, int, int]] = {}
        """Per request holding tables: (slots, computed, cached) limits below which a step
        changes nothing (see `SingleTypeManager.quiet_limits`)."""
        self._config = config
        self._no_blocks = KVCacheBlocks.empty(self.num_groups)
        self._no_hit = CacheHit(self._no_blocks, 0, 0, ())
        self._num_queries = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._group_hit_tokens = [0] * self.num_groups
        self._miss_tokens: list[dict[str, int]] = [{} for _ in range(self.num_groups)]
        self._unexplained: tuple[tuple[tuple[str, int], ...], ...] = ((),) * self.num_groups

    def release_spec_slots(self, req_id: str) -> bool:
        """Free a running request's draft-state slots to make room (False: it held none)."""
        return self.spec_slots is not None and self.spec_slots.release(req_id)

    def enable_spec_slots(self, num_speculative_tokens: int, draft_lookahead: int = 0) -> None:
        """Speculative decoding with k drafts: drafting requests hold k draft-position states
        per recurrent group (`scheduler.kv_cache.spec_slots`); a drafter model's groups also
        get `draft_lookahead` slots past each step's tokens. Call before any allocation."""
        self.draft_lookahead = draft_lookahead
        self.coordinator.set_drafter_lookahead(draft_lookahead, self.max_model_len)
        managers = [m for m in self.coordinator.managers if isinstance(m, MambaManager)]
        if self.checkpoints is not None:
            self.checkpoints.keep_answer_ends = False
        if managers:
            self.spec_slots = SpecStateSlots(managers, self.pool, num_speculative_tokens)

    @property
    def hash_block_size(self) -> int:
        """Tokens per request block hash: gcd of the group block sizes (lcm when caching off)."""
        return self._hash_block_size

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def usage_per_group(self) -> tuple[float, ...]:
        return self.pool.usage_per_group()

    def get_computed_blocks(self, request: Request) -> CacheHit:
        """Longest prefix-cache hit of a new request (the last prompt token is never a hit).

        A request that asks for prompt logprobs reads nothing from the cache (every prompt token
        must be computed to score it); its blocks are still registered for later requests.
        Counts and explains nothing: `explain_misses` and `record_lookup` do, once the request
        is admitted.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return self._no_hit
        if request.hash_block_size != self._hash_block_size:
            raise ValueError(
                f"request {request.req_id!r} hashes blocks of {request.hash_block_size} tokens, "
                f"the cache uses {self._hash_block_size}"
            )
        found = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        junction = max(found.num_tokens, *found.group_hit_tokens)
        blocks = KVCacheBlocks(found.blocks)
        num_hit, group_hits = found.num_tokens, found.group_hit_tokens
        if self.checkpoints is not None:
            fine = self.checkpoints.find(request, request.block_hashes, num_hit)
            if fine is not None:
                blocks = KVCacheBlocks(fine.blocks, fine.sources)
                num_hit = fine.num_tokens
                junction = max(junction, num_hit)
                group_hits = tuple(max(hit, num_hit) for hit in group_hits)
        offloaded = count_offloaded(blocks.blocks) if self.pool.offload is not None else 0
        return CacheHit(blocks, num_hit, junction, group_hits, (), offloaded)

    def explain_misses(self, request: Request, hit: CacheHit) -> CacheHit:
        """`hit` with its `misses` filled in: per group, why the lookup missed what it missed.

        Called once per admission, just before the admitting allocation, not on every lookup
        (a request waiting at the head of the queue is looked up every step). Before: that
        allocation registers the request's own blocks and may evict cached ones, so explaining
        after it would describe a cache the lookup did not see (a block the lookup found, then
        evicted by the admitting allocation itself, would read "evicted"). The offload tier
        notes here, once per admitted request, whether it thrashes on the request's session.
        """
        if not hit.group_hit_tokens:
            return hit
        if self.pool.offload is not None:
            num_hit_blocks = hit.num_tokens // self._hash_block_size
            self.pool.offload.note_hit_end(request.req_id, request.block_hashes, num_hit_blocks)
        misses = explain_misses(
            self.coordinator.managers,
            self.pool,
            request,
            hit.group_hit_tokens,
            self.alignment_tokens,
        )
        return hit._replace(misses=misses)

    def record_lookup(self, request: Request, hit: CacheHit) -> None:
        """Count an admitted request's lookup in the prefix-cache counters.

        Called on admission rather than on lookup, so that a request waiting for room several
        steps is counted once. Miss reasons count when `hit` was explained (`explain_misses`).
        """
        if not hit.group_hit_tokens:
            return
        self._num_queries += 1
        self._query_tokens += request.num_tokens
        self._hit_tokens += hit.num_tokens
        for group_id, tokens in enumerate(hit.group_hit_tokens):
            self._group_hit_tokens[group_id] += tokens
        for totals, misses in zip(self._miss_tokens, hit.misses or self._unexplained, strict=True):
            for reason, tokens in misses:
                totals[reason] = totals.get(reason, 0) + tokens

    def get_num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> int:
        """Free blocks `allocate_slots` would take now (before out-of-window frees); no change."""
        total_computed = min(
            request.num_computed_tokens + num_new_computed_tokens, self.max_model_len
        )
        num_slots = min(total_computed + num_new_tokens, self.max_model_len)
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else None
        needed = self.coordinator.get_num_blocks_to_allocate(
            request.req_id, num_slots, hits, total_computed
        )
        return needed + self._num_copy_blocks(new_computed_blocks, num_slots)

    def _num_copy_blocks(self, hit: KVCacheBlocks | None, num_slots: int) -> int:
        if hit is None or not hit.copy_sources or self.checkpoints is None:
            return 0
        return self.checkpoints.extra_blocks(hit.blocks, hit.copy_sources, num_slots)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` (+ lookahead) after the computed and hit tokens.

        All-or-nothing over groups: None when the pool is short (nothing taken; out-of-window
        blocks of the request may have been freed). Registers the full blocks among the tokens
        computed through this step. Returns the table entries this call appended, per group
        (new blocks, and the null entries a Mamba group puts before its new state block).
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        end = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        if self.checkpoints is not None and self.checkpoints.wants(request, end):
            return self._allocate_saving_checkpoints(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
            )
        limits = self._quiet.get(request.req_id)
        phases = ALL_PHASES
        if (
            limits is not None
            and self._use_quiet_path
            and new_computed_blocks is None
            and not num_new_computed_tokens
            and request.num_computed_tokens <= self.max_model_len
        ):  # only the phases whose limits the step crosses; none: nothing to do (decodes)
            ahead = num_lookahead_tokens + self.draft_lookahead
            computed = request.num_computed_tokens
            phases = step_phases(limits, computed, num_new_tokens, ahead, request.num_tokens)
            if not any(phases):
                return self._no_blocks
        return self._allocate(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            phases,
        )

    def _allocate_saving_checkpoints(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
    ) -> KVCacheBlocks | None:
        """`_allocate` (no quiet path: a step inside a block may save a checkpoint), then the
        checkpoints among the tokens this step computes."""
        assert self.checkpoints is not None
        blocks = self._allocate(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
        )
        if blocks is not None:
            start = request.num_computed_tokens + num_new_computed_tokens
            self.checkpoints.plan_saves(request, start, start + num_new_tokens)
        return blocks

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        phases: StepPhases = ALL_PHASES,
    ) -> KVCacheBlocks | None:
        req_id = request.req_id
        is_new = req_id not in self._quiet
        if not is_new and (
            num_new_computed_tokens
            or (new_computed_blocks is not None and not new_computed_blocks.is_empty)
        ):
            raise ValueError(f"request {req_id!r} already holds blocks: no new hits")
        local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(local_computed, self.max_model_len)
        main_tokens = total_computed + num_new_tokens
        num_slots = min(main_tokens + num_lookahead_tokens, self.max_model_len)
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else None
        coordinator = self.coordinator
        if phases.frees:
            coordinator.remove_skipped_blocks(req_id, total_computed)
        needed = 0
        if phases.grows:
            needed = coordinator.get_num_blocks_to_allocate(req_id, num_slots, hits, total_computed)
        if is_new:
            needed += self._num_copy_blocks(new_computed_blocks, num_slots)
        if needed > self.pool.num_free_blocks:
            if not is_new:
                self._quiet[req_id] = coordinator.quiet_limits(req_id, self.enable_caching)
            return None
        if is_new:
            self._adopt_hit(req_id, new_computed_blocks, local_computed)
        new_blocks = coordinator.allocate_new_blocks(req_id, num_slots) if phases.grows else ()
        if self.enable_caching and phases.caches:
            num_known = min(main_tokens, request.num_tokens)
            coordinator.cache_blocks(req_id, request.block_hashes, num_known)
        self._quiet[req_id] = coordinator.quiet_limits(req_id, self.enable_caching)
        if not any(new_blocks):
            return self._no_blocks
        return KVCacheBlocks(new_blocks)

    def _adopt_hit(self, req_id: str, hit: KVCacheBlocks | None, num_computed: int) -> None:
        """Start a new request's tables from its prefix hit (and the hit's state copies)."""
        self.coordinator.allocate_new_computed_blocks(
            req_id, hit.blocks if hit is not None else None, num_computed
        )
        if self.pool.offload is not None:
            self.pool.offload.fill(self.pool)
        if hit is not None and hit.copy_sources:
            assert self.checkpoints is not None
            self.checkpoints.adopt(req_id, hit.copy_sources)

    def free(self, request: Request) -> None:
        """Release every block of a finished or preempted request (cached ones stay hit-able)."""
        if self.pool.offload is not None:
            self.pool.offload.cancel(request.req_id)
        if self._quiet.pop(request.req_id, None) is not None:
            if self.enable_caching:  # async scheduling: blocks filled by tokens computed ahead
                known = min(request.num_computed_tokens, request.num_tokens)
                self.coordinator.cache_blocks(request.req_id, request.block_hashes, known)
            if self.checkpoints is not None:
                self.checkpoints.keep_answer_end(request, request.status.is_finished)
            self.coordinator.free(request.req_id, request.block_hashes)
            if self.pool.offload is not None:
                clock = self.pool.chains.clock if self.pool.chains is not None else None
                self.pool.offload.protect_if_thrashed(request.req_id, clock)
        if self.checkpoints is not None:
            self.checkpoints.forget(request.req_id)
        if self.spec_slots is not None:
            self.spec_slots.free(request.req_id)

    def take_step_ops(self) -> tuple[list[BlockCopy], list[StateSave], list[BlockCopy]]:
        """The worker ops of the step being scheduled (copies before it, state saves, copies
        after it): fine checkpoints, and draft-position states of speculative decoding. Call
        once per step, as its output is built."""
        before: list[BlockCopy] = []
        saves: list[StateSave] = []
        after: list[BlockCopy] = []
        if self.checkpoints is not None:
            before, saves, after = self.checkpoints.take_step_ops()
        if self.spec_slots is not None:
            restores, draft_saves = self.spec_slots.take_ops()
            before = restores + before  # read the slots before any copy may reuse them
            saves += draft_saves
        return before, saves, after

    def finish_load(self, request: Request, succeeded: bool) -> None:
        """The workers ended the request's offload-tier loads (see `OffloadIndex.finish`)."""
        if self.pool.offload is not None:
            self.pool.offload.finish(self.pool, request.req_id, succeeded)

    def take_offload_ops(self) -> OffloadOps:
        """The offload-tier copies of the step being scheduled (none without a tier)."""
        return self.pool.offload.take_ops() if self.pool.offload is not None else OffloadOps()

    def begin_step(self) -> None:
        """Start scheduling a step: the checkpoints written by the steps sent so far become
        hit-able (call before any lookup of the step)."""
        if self.checkpoints is not None:
            self.checkpoints.register_written()

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's current table per group (null entries are 0)."""
        return tuple(map(block_ids, self.coordinator.get_blocks(req_id)))

    def get_num_common_prefix_blocks(
        self, req_id: str, num_running_requests: int
    ) -> tuple[int, ...]:
        """Per group, leading blocks of `req_id` that every running request shares."""
        return self.coordinator.get_num_common_prefix_blocks(req_id, num_running_requests)

    def uncache_blocks(self, req_id: str) -> None:
        """Drop the request's blocks from the prefix cache (their contents cannot be trusted);
        the request keeps them until it is freed."""
        for group_block_ids in self.get_block_ids(req_id):
            self.pool.evict_blocks(group_block_ids)
        if self.checkpoints is not None:
            self.checkpoints.forget(req_id, keep_sent=False)

    def uncache_uncomputed(self, request: Request) -> None:
        """Unregister the request's blocks past its computed tokens (their step was withdrawn)."""
        self.coordinator.uncache_from(request.req_id, request.num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; fails (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def enable_offload(self, config: OffloadConfig) -> None:
        """Keep the blocks the pool evicts in an offload tier (host memory, then disk) and find
        hits there too (`scheduler.kv_cache.offload`); nothing without caching."""
        if self.enable_caching and self.pool.offload is None:
            index = build_offload_index(self._config, config)
            index.event_sink = self.pool.event_sink
            self.pool.attach_offload(index)

    def enable_events(self) -> None:
        """Start collecting KV events (prefix-cache keys stored and removed) for `take_events`."""
        if self.pool.event_sink is None and self.enable_caching:
            self.pool.event_sink = KVEventSink(self.num_groups)
            if self.pool.offload is not None:
                self.pool.offload.event_sink = self.pool.event_sink

    def take_events(self) -> KVEventBatch | None:
        """The KV events since the last take (None: none, or events off)."""
        sink = self.pool.event_sink
        return sink.take() if sink is not None else None

    def eviction_outlook(
        self, running: Sequence[Request], limit: int = OUTLOOK_BLOCKS
    ) -> EvictionOutlook | None:
        """The keys the pool would evict next, in its order, with how far the `running`
        requests are (None: events off)."""
        return pool_eviction_outlook(self.pool, running, limit)

    def make_stats(self) -> KVCacheStats:
        """A snapshot of usage and the cumulative prefix-cache counters."""
        return KVCacheStats(
            usage=self.pool.usage,
            group_usage=self.pool.usage_per_group(),
            num_queries=self._num_queries,
            query_tokens=(self._query_tokens,) * self.num_groups,
            group_hit_tokens=tuple(self._group_hit_tokens),
            hit_tokens=self._hit_tokens,
            num_evictions=self.pool.num_evictions,
            group_miss_tokens=tuple(tuple(misses.items()) for misses in self._miss_tokens),
            offload=self.pool.offload.counters() if self.pool.offload is not None else None,
            group_pressure=group_pressure(self.pool, self.coordinator.group_specs),
        )

    def check_invariants(self) -> None:
        """Assert pool and table consistency (tests)."""
        pending = self.checkpoints.held_blocks() if self.checkpoints is not None else []
        if self.spec_slots is not None:
            pending += self.spec_slots.held_blocks()
        self.coordinator.check_invariants(pending)
        if self.pool.offload is not None:
            self.pool.offload.check_invariants()
        if self.num_groups:
            held = set().union(*(manager.req_to_blocks for manager in self.coordinator.managers))
            assert set(self._quiet) == held, (set(self._quiet), held)

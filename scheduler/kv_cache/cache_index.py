"""An approximate copy of one engine's prefix-cache keys, and the hit that engine would find.

A router keeps one `CacheIndex` per replica, fed by the replica's KV events (`replay`) and by its
own guesses (`guess_stored`: the blocks the prompt it just sent there will compute will be cached;
a guess the events do not confirm within `guess_ttl`, or by the time they show that prompt's
prefill done, is forgotten). `predict_hit` runs the scheduler's own coordinator
(the fixed point across groups) on hash maps that hold the indexed keys, so a replica that lost
the window tail or the Mamba state of a prefix is predicted to miss it, as the engine will.

Events arrive a poll period late, and meanwhile the engine evicts to make room for the requests
the router keeps sending it. So the index anticipates evictions: the blocks the engine will
allocate are the guesses its events have not confirmed yet; they come from the free blocks the
engine's last `EvictionOutlook` lists, in its eviction order (those a routed prompt hits are
taken back by its request, not evicted); the keys they would evict are left out of the index
until the engine's events say whether they went.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from scheduler.block_hash import SEED, BlockHash, extend_block_hashes
from scheduler.kv_cache.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_cache.coordinator import CoordinatorHit, make_coordinator
from scheduler.kv_cache.events import EvictionOutlook, KVEventBatch, KVEventWindow
from scheduler.kv_cache.mamba_manager import MambaManager
from scheduler.kv_cache.offload_levels import DeviceOrOffloaded
from scheduler.kv_cache.single_type_manager import SingleTypeManager
from scheduler.kv_cache.spec import KVCacheGroupSpec, MambaCacheMode

logger = logging.getLogger(__name__)

MAX_TRACKED_PROMPTS = 1 << 12
"""Routed prompts whose completion the index watches for (the oldest are forgotten)."""
_INDEXED = KVCacheBlock(1)
"""What an index hash map holds for every key: lookups only ask whether a key is there."""


class CacheIndex:
    """Keys (hash, group) one engine can hit, replayed from its events plus recent guesses."""

    def __init__(
        self,
        groups: Sequence[KVCacheGroupSpec],
        guess_ttl: float = 10.0,
        steps_ahead: float = 0.0,
    ) -> None:
        if not groups:
            raise ValueError("a cache index needs at least one KV cache group")
        self.groups = tuple(groups)
        sizes = [group.spec.block_size for group in groups]
        self.hash_block_size = math.gcd(*sizes)
        """Tokens per block hash: the engine's (gcd of the group block sizes)."""
        self.hash_root = SEED
        """The root of the engine's block hashes, as its latest events say."""
        self._pool = BlockPool(1, len(groups))
        self._coordinator = make_coordinator(groups, self._pool, self.hash_block_size, True)
        self._tier_maps: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in groups]
        """Per group, the keys the engine's offload tier holds (from its events)."""
        tiered = BlockPool(1, len(groups))
        tiered.lookup_maps = [
            DeviceOrOffloaded(device, (tier,))
            for device, tier in zip(self._pool.hash_maps, self._tier_maps, strict=True)
        ]
        self._tiered_coordinator = make_coordinator(groups, tiered, self.hash_block_size, True)
        """Finds hits over device ∪ tier keys (the engine's own lookup with a tier)."""
        self.guess_ttl = guess_ttl
        self.steps_ahead = steps_ahead
        """Engine steps from the eviction outlook the index holds to the admission of a request
        routed now (the poll period in steps, and one): the running requests' decodes
        allocate meanwhile."""
        self._guesses: dict[tuple[int, BlockHash], float] = {}
        """Guessed keys not confirmed by an event yet -> when they expire."""
        self._guess_order: deque[tuple[float, int, BlockHash]] = deque()
        self.next_seq = 0
        """Sequence number of the next event batch to replay."""
        self._outlook: EvictionOutlook | None = None
        self._victims: dict[tuple[int, BlockHash], None] = {}
        """Keys the engine holds as of its events but is expected to evict by now."""
        self._pending: list[_Pending] = []
        """Routed prompts not computed yet, as far as the events say."""
        self._last_guesses: dict[tuple[int, BlockHash], list[tuple[int, BlockHash]]] = {}
        """The last-ending guess of each routed prompt -> all its guesses: once an event
        confirms it, the prompt's prefill is done, and its guesses still unconfirmed are keys
        the engine did not store (they were in its hit, or its chunks ended elsewhere)."""

    @property
    def num_keys(self) -> int:
        return sum(len(hash_map) for hash_map in self._pool.hash_maps)

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> list[BlockHash]:
        """The engine's block hashes of a prompt (from the root of its weights)."""
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, token_ids, self.hash_block_size, cache_salt, self.hash_root)
        return hashes

    def predict_hit(self, block_hashes: Sequence[BlockHash], num_tokens: int, now: float) -> int:
        """Tokens of a `num_tokens`-token prompt the engine would serve from its device pool."""
        self._expire(now)
        return self._coordinator.find_longest_cache_hit(block_hashes, num_tokens - 1).num_tokens

    def predict_tier_hit(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int:
        """Tokens the engine would serve from its device pool and offload tier together (at
        least `predict_hit`; the excess costs the engine a load)."""
        if not any(self._tier_maps):
            return 0
        found = self._tiered_coordinator.find_longest_cache_hit(block_hashes, num_tokens - 1)
        return found.num_tokens

    def guess_stored(self, block_hashes: Sequence[BlockHash], num_tokens: int, now: float) -> None:
        """Index what the engine will cache once it has computed these tokens (its reachable
        full blocks in every group), until events confirm it or `guess_ttl` passes."""
        expiry = now + self.guess_ttl
        guessed: list[tuple[int, BlockHash]] = []
        hit = self._coordinator.find_longest_cache_hit(block_hashes, num_tokens - 1)
        hits = self._hit_keys(hit.blocks, block_hashes)
        num_new = 0
        last: tuple[int, tuple[int, BlockHash]] | None = None
        for manager in self._coordinator.managers:
            hash_map = self._pool.hash_maps[manager.group_id]
            num_full = min(
                num_tokens // manager.block_size, len(block_hashes) // manager.hash_ratio
            )
            num_new += _num_new_blocks(manager, num_tokens, hit)
            for index in _guessed_blocks(manager, num_tokens, hit, num_full):
                if not manager.is_reachable(index):
                    continue
                key = manager.hash_of(block_hashes, index)
                if (manager.group_id, key) in self._victims:
                    continue  # the engine may still hold it: its events will say
                if key in hash_map and (manager.group_id, key) not in self._guesses:
                    continue  # known from an event
                hash_map[key] = _INDEXED
                self._guesses[(manager.group_id, key)] = expiry
                self._guess_order.append((expiry, manager.group_id, key))
                guessed.append((manager.group_id, key))
                end = (index + 1) * manager.block_size
                if last is None or end > last[0]:
                    last = (end, (manager.group_id, key))
        if guessed:
            self._pending.append(_Pending(guessed, hits, num_new))
        if last is not None:
            self._last_guesses[last[1]] = guessed
            while len(self._last_guesses) > MAX_TRACKED_PROMPTS:
                del self._last_guesses[next(iter(self._last_guesses))]
        self._anticipate_evictions()

    def _decode_blocks(self, running: Sequence[tuple[int, int]]) -> int:
        """Blocks the `running` requests (tokens computed, most tokens left) allocate over
        `steps_ahead` decode steps: one in a group each time a request crosses its block size."""
        steps = int(self.steps_ahead)
        return sum(
            -(-(computed + min(steps, left)) // size) - -(-computed // size)
            for computed, left in running
            for size in (manager.block_size for manager in self._coordinator.managers)
        )

    def _hit_keys(
        self, blocks: Sequence[Sequence[KVCacheBlock]], block_hashes: Sequence[BlockHash]
    ) -> list[tuple[int, BlockHash]]:
        """The keys of a hit's blocks (its skipped blocks are the null block)."""
        null = self._pool.null_block
        return [
            (manager.group_id, manager.hash_of(block_hashes, index))
            for manager in self._coordinator.managers
            for index, block in enumerate(blocks[manager.group_id])
            if block is not null
        ]

    def replay(self, window: KVEventWindow) -> None:
        """Apply the batches of `window` not replayed yet; after a gap (batches that left the
        engine's log unseen, or a new log) start over from what the window holds."""
        if window.first_seq > self.next_seq or window.next_seq < self.next_seq:
            logger.info("KV events missed (%d..%d): index rebuilt", self.next_seq, window.first_seq)
            self.clear()
            self.next_seq = window.first_seq
        for batch in window.batches[self.next_seq - window.first_seq :]:
            self.apply(batch)
        self.next_seq = window.next_seq
        self._outlook = window.outlook
        self._anticipate_evictions()

    def _anticipate_evictions(self) -> None:
        """Leave out of the index the keys the engine evicts for the blocks it still has to
        allocate (the unconfirmed guesses), in its last outlook's order."""
        maps = self._pool.hash_maps
        for group_id, key in self._victims:
            maps[group_id][key] = _INDEXED
        self._victims.clear()
        if self._outlook is None:
            return
        guesses = self._guesses
        self._pending = [
            pending
            for pending in self._pending
            if all(entry in guesses for entry in pending.guessed)
        ]
        taken_back = {entry for pending in self._pending for entry in pending.hits}
        demand = sum(pending.num_new_blocks for pending in self._pending)
        demand += self._decode_blocks(self._outlook.running)
        for entry in self._outlook.order:
            if demand <= 0:
                break
            if entry is not None and entry in taken_back:
                continue
            demand -= 1
            if entry is not None and entry[1] in maps[entry[0]] and entry not in guesses:
                del maps[entry[0]][entry[1]]
                self._victims[entry] = None

    def apply(self, batch: KVEventBatch) -> None:
        """Replay one batch of events."""
        if batch.cleared:
            self.clear()
        self.hash_root = batch.hash_root
        guesses = self._guesses
        done: list[tuple[int, BlockHash]] = []
        for group_id, (stored, removed) in enumerate(zip(batch.stored, batch.removed, strict=True)):
            hash_map = self._pool.hash_maps[group_id]
            for key in removed:
                hash_map.pop(key, None)
                guesses.pop((group_id, key), None)
                self._victims.pop((group_id, key), None)
            for key in stored:
                hash_map[key] = _INDEXED
                guesses.pop((group_id, key), None)
                done.extend(self._last_guesses.pop((group_id, key), ()))
        for entry in done:  # guesses of prompts whose prefill is done, not confirmed
            if guesses.pop(entry, None) is not None:
                self._pool.hash_maps[entry[0]].pop(entry[1], None)
        for group_id, (stored, removed) in enumerate(
            zip(batch.tier_stored, batch.tier_removed, strict=True)
        ):
            tier_map = self._tier_maps[group_id]
            for key in removed:
                tier_map.pop(key, None)
            tier_map.update(dict.fromkeys(stored, _INDEXED))

    def clear(self) -> None:
        """Forget every key."""
        for hash_map in (*self._pool.hash_maps, *self._tier_maps):
            hash_map.clear()
        self._guesses.clear()
        self._guess_order.clear()
        self._victims.clear()
        self._pending.clear()
        self._last_guesses.clear()

    def _expire(self, now: float) -> None:
        order = self._guess_order
        while order and order[0][0] <= now:
            expiry, group_id, key = order.popleft()
            if self._guesses.get((group_id, key)) == expiry:
                del self._guesses[(group_id, key)]
                self._pool.hash_maps[group_id].pop(key, None)


class _Pending(NamedTuple):
    """A routed prompt whose guesses the engine's events have not all confirmed yet."""

    guessed: list[tuple[int, BlockHash]]
    """Its guesses: the first one confirmed says its prefill began (allocated its blocks)."""
    hits: list[tuple[int, BlockHash]]
    """Keys it hits: its request takes them back from the free blocks before allocating."""
    num_new_blocks: int
    """Blocks its request allocates over every group (its prompt past the hit)."""


def _num_new_blocks(manager: SingleTypeManager, num_tokens: int, hit: CoordinatorHit) -> int:
    """Blocks a request for `num_tokens` tokens takes from the free queue in this group as its
    prefill runs from its `hit` (a sliding window too: a chunk's blocks are all allocated before
    those that leave the window are given back); in a Mamba group in ALIGN mode, one per
    prefill chunk (its state block)."""
    if _aligned_mamba(manager):
        return len(_chunk_ends(manager, num_tokens, hit))
    return max(-(-num_tokens // manager.block_size) - hit.num_tokens // manager.block_size, 0)


def _guessed_blocks(
    manager: SingleTypeManager, num_tokens: int, hit: CoordinatorHit, num_full: int
) -> list[int]:
    """Blocks of a prompt's `num_full` full blocks its engine will register when its prefill
    starts from its `hit`: those it computes (the blocks before the hit that the engine lacks,
    e.g. a window's, it does not compute again), but in a Mamba group kept in ALIGN mode only
    the states where its prefill chunks end on a block boundary."""
    size = manager.block_size
    if not _aligned_mamba(manager):
        return list(range(hit.num_tokens // size, num_full))
    ends = _chunk_ends(manager, num_tokens, hit)
    return sorted({end // size - 1 for end in ends if end % size == 0 and end // size <= num_full})


def _chunk_ends(manager: SingleTypeManager, num_tokens: int, hit: CoordinatorHit) -> set[int]:
    """Where the engine ends a prompt's prefill chunks in a Mamba ALIGN group (the token budget
    permitting): the shared-prefix junction (the longest hit of any single group, where it
    stops so that the next prompt sharing that prefix hits the state there), the last aligned
    boundary before the prompt's last token, and the prompt's end."""
    junction = max(hit.num_tokens, *hit.group_hit_tokens)
    last_boundary = (num_tokens - 1) // manager.hit_alignment * manager.hit_alignment
    return {end for end in (junction, last_boundary, num_tokens) if end > hit.num_tokens}


def _aligned_mamba(manager: SingleTypeManager) -> bool:
    return isinstance(manager, MambaManager) and manager.mode is MambaCacheMode.ALIGN

"""Recurrent-state checkpoints at a prefix-match unit finer than the block (Mamba hybrids).

A hybrid's unified block can be hundreds of tokens long, and a recurrent state is kept only at
block ends: prompts sharing less than one block never hit. With `prefix_match_unit` u smaller
than the hit alignment B, a request also saves checkpoints at positions p on the u grid of its
prompt, spaced
max(u, u * floor(0.1 * p / u)) apart (so every prefix has one within 10 % below it) and at most
`max_per_request` of them. A checkpoint at p is, per group, one pool block keyed by the
chained hash of the tokens before p (a hash chain at u tokens, tagged so it never equals a block
hash):

    state groups      the state after token p - 1 (the worker cuts it out of the chunk, or
                      copies the chunk's final state when p ends the chunk)
    attention groups  a copy of the block holding tokens [p // B * B, p), when p is mid-block

A later prompt sharing p tokens hits the attention groups' full blocks by hash as usual, plus
fresh blocks for the rest, which the workers fill from the checkpoint before the step
(copy-on-write: the checkpoint itself is never written). Checkpoint blocks are registered (and
become evictable like any cached block) at the step after the one that wrote them, and count in
the pool like every other block.

Two more kinds of checkpoint make a chat's next turn resume where the last one ended:
    prompt end   a save at the last unit-grid position of the prompt (a regenerated answer or
                 an edited next message starts there)
    answer end   a finished request leaves its own state and partial attention blocks in the
                 cache, keyed at its exact computed length (no copy: the blocks are registered
                 as they are freed); the next turn, which extends the prompt and the answer,
                 resumes there. The end checkpoint a request resumed from is evicted first once
                 the request leaves its own (nothing reaches it any more but an edited turn).
Answer ends are left without speculative decoding only: after a verify step with rejected drafts
the running state is restored at the request's next step, which a finished request never has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from scheduler.block_hash import (
    SEED,
    BlockHash,
    extend_block_hashes,
    hash_block_tokens,
)
from scheduler.kv_cache.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_cache.mamba_manager import MambaManager
from scheduler.kv_cache.single_type_manager import SingleTypeManager
from scheduler.kv_cache.spec import MambaCacheMode, cdiv
from scheduler.output import BlockCopy, StateSave
from scheduler.request import Request

DEFAULT_MAX_PER_REQUEST = 64
"""Most checkpoints one request saves (the 10 % spacing needs about 40 up to 16k tokens)."""

FREE_SHARE_KEPT = 8
"""A checkpoint is saved only while more than 1/8 of the pool stays free after it: it is an
optimisation, and must not take the blocks running requests grow into."""

HELD_SHARE = 20
"""Checkpoints not registered yet (written by a step in flight: nothing can evict them) hold at
most 1/20 of the pool (or MIN_HELD checkpoints' blocks in a small pool). A step plans its prompt
ends first, then each prompt's 10 % grid from the step's end down (on a Granite-4.0-H-Small
layout in 40 GiB: 23 checkpoints, shared prefixes down to a ninth of the step's end)."""

MIN_HELD = 2
"""Checkpoints' worth of blocks a small pool may hold unregistered whatever its size (a prompt's
end and one more)."""

_TAG = b"state-checkpoint"
_END_TAG = b"state-end"


def checkpoint_positions(num_tokens: int, unit: int, limit: int) -> list[int]:
    """Grid positions in [unit, num_tokens], each at most 10 % past the previous (or one unit)."""
    positions: list[int] = []
    position = unit
    while position <= num_tokens and len(positions) < limit:
        positions.append(position)
        position = next_position(position, unit)
    return positions


def next_position(position: int, unit: int) -> int:
    """The checkpoint after the one at `position`: max(unit, unit * floor(0.1 * position / unit))
    further."""
    return position + max(unit, unit * (position // (10 * unit)))


def checkpoint_keys(
    token_ids: Sequence[int], unit: int, salt: str | None, root: BlockHash = SEED
) -> list[BlockHash]:
    """Key j names the first (j + 1) * unit tokens (salted and rooted like the block hashes)."""
    chain: list[BlockHash] = []
    extend_block_hashes(chain, token_ids, unit, salt, root)
    return [xxhash.xxh3_128_digest(digest + _TAG) for digest in chain]


def end_key(grid_key: BlockHash, tail: Sequence[int]) -> BlockHash:
    """Key of an answer-end checkpoint: the unit-grid key before it and the tokens after it."""
    return xxhash.xxh3_128_digest(hash_block_tokens(grid_key, tail) + _END_TAG)


class FineHit(NamedTuple):
    """A hit at a checkpoint: tables to start from, and the blocks to copy after them."""

    num_tokens: int
    blocks: tuple[list[KVCacheBlock], ...]
    sources: tuple[KVCacheBlock | None, ...]
    """Per group, the checkpoint block a fresh block after `blocks` is filled from (None: none)."""


@dataclass
class _Pending:
    """One checkpoint not registered yet: its key and block per group."""

    key: BlockHash
    written: list[tuple[int, KVCacheBlock]] = field(default_factory=list)
    sent: bool = False
    """Its worker ops left with a step (else they are still being planned)."""


class StateCheckpoints:
    """Checkpoints of every group of one model (see the module docstring)."""

    def __init__(
        self,
        managers: Sequence[SingleTypeManager],
        pool: BlockPool,
        unit: int,
        max_per_request: int = DEFAULT_MAX_PER_REQUEST,
    ) -> None:
        self.managers = list(managers)
        self.pool = pool
        self.unit = unit
        self.max_per_request = max_per_request
        self.state_groups = [m.group_id for m in managers if isinstance(m, MambaManager)]
        self.max_held_blocks = max(pool.num_blocks // HELD_SHARE, MIN_HELD * len(self.managers))
        """Most blocks unregistered checkpoints hold (`HELD_SHARE`)."""
        self._chains: dict[str, tuple[list[BlockHash], list[BlockHash]]] = {}
        """Per request, its hash chain at `unit` tokens and the checkpoint keys made from it."""
        self._next: dict[str, tuple[int, int]] = {}
        """Per request, (next checkpoint position, checkpoints planned or passed so far)."""
        self._pending: dict[str, list[_Pending]] = {}
        self._copies_before: list[tuple[str, BlockCopy]] = []
        self._copies_after: list[tuple[str, BlockCopy]] = []
        self._state_saves: list[StateSave] = []
        """Worker ops planned for the step being scheduled (with the request they serve)."""
        self.keep_answer_ends = True
        """Leave finished requests' end states in the cache (off with speculative decoding)."""
        self._ends: dict[BlockHash, dict[int, BlockHash]] = {}
        """Answer-end checkpoints: unit-grid key before them -> {position: end key}."""
        self._end_keys: set[BlockHash] = set()
        """Every end key in `_ends` (swept of evicted ones when it outgrows the pool)."""
        self._resumed: dict[str, list[tuple[KVCacheBlock, BlockHash]]] = {}
        """Per request resumed from an answer end: that end's blocks (and its key)."""
        self._untrusted: set[str] = set()
        """Requests whose blocks a failed step left untrustworthy (no end checkpoint)."""

    @classmethod
    def create(
        cls, managers: Sequence[SingleTypeManager], pool: BlockPool, unit: int | None, caching: bool
    ) -> StateCheckpoints | None:
        """Checkpoints when `unit` is finer than a state group's hits; None otherwise."""
        states = [m for m in managers if isinstance(m, MambaManager)]
        if not caching or unit is None or not states:
            return None
        if any(m.mode is MambaCacheMode.NONE for m in states) or unit >= states[0].hit_alignment:
            return None  # a state kept per request, or hits on the unit grid already
        return cls(managers, pool, unit)

    def describe(self) -> str:
        """One line for the start-up log: the grid and what one checkpoint costs."""
        num_states = len(self.state_groups)
        num_attention = len(self.managers) - num_states
        usable = self.pool.num_blocks - 1
        share = 100 * (num_states + num_attention) / usable
        return (
            f"prefix_match_unit {self.unit}: state checkpoints on a {self.unit}-token grid inside "
            f"{self.managers[0].hit_alignment}-token hybrid blocks, at prompt and answer ends; "
            f"one takes {num_states} state slots + up to {num_attention} attention blocks "
            f"({share:.2f} % of the {usable}-block pool), evictable like cached blocks, and is "
            f"saved only while 1/{FREE_SHARE_KEPT} of the pool stays free (at most "
            f"1/{HELD_SHARE} of it held by checkpoints a step in flight writes)"
        )

    def _request_keys(self, request: Request) -> list[BlockHash]:
        """Keys of every full unit of the request's tokens (extended as outputs arrive)."""
        chain, keys = self._chains.setdefault(request.req_id, ([], []))
        extend_block_hashes(
            chain, request.cache_token_ids, self.unit, request.hash_salt, request.hash_root
        )
        keys.extend(xxhash.xxh3_128_digest(digest + _TAG) for digest in chain[len(keys) :])
        return keys

    # Lookup

    def find(self, request: Request, block_hashes: Sequence[BlockHash], hit: int) -> FineHit | None:
        """The longest checkpoint hit longer than `hit` tokens (at most all tokens but one)."""
        tokens = request.cache_token_ids[: request.num_tokens - 1]
        keys = checkpoint_keys(tokens, self.unit, request.hash_salt, request.hash_root)
        maps = self.pool.hash_maps
        for index in range(len(keys) - 1, -1, -1):
            position = (index + 1) * self.unit
            end = self._find_end(keys[index], tokens, block_hashes, position, hit)
            if end is not None:
                return end
            if position <= hit:
                return None
            key = keys[index]
            if any(key not in maps[group_id] for group_id in self.state_groups):
                continue
            found = self._restore(block_hashes, key, position)
            if found is not None:
                return found
        return None

    def _find_end(
        self,
        grid_key: BlockHash,
        tokens: Sequence[int],
        block_hashes: Sequence[BlockHash],
        grid_position: int,
        hit: int,
    ) -> FineHit | None:
        """The longest answer-end checkpoint after the grid position `grid_key` names, within
        `tokens` and longer than `hit` (stale entries, evicted since, are dropped)."""
        ends = self._ends.get(grid_key)
        if not ends:
            return None
        state_map = self.pool.hash_maps[self.state_groups[0]]
        for position in sorted(ends, reverse=True):
            key = ends[position]
            if key not in state_map:
                del ends[position]
                self._end_keys.discard(key)
                continue
            if position <= hit or position > len(tokens):
                continue
            if end_key(grid_key, tokens[grid_position:position]) != key:
                continue
            if all(key in self.pool.hash_maps[group_id] for group_id in self.state_groups):
                found = self._restore(block_hashes, key, position)
                if found is not None:
                    return found
        if not ends:
            del self._ends[grid_key]
        return None

    def _restore(
        self, block_hashes: Sequence[BlockHash], key: BlockHash, position: int
    ) -> FineHit | None:
        blocks: list[list[KVCacheBlock]] = []
        sources: list[KVCacheBlock | None] = []
        null = self.pool.null_block
        for manager in self.managers:
            size, group_id = manager.block_size, manager.group_id
            if isinstance(manager, MambaManager):
                blocks.append([null] * ((position - 1) // size))
                sources.append(self.pool.hash_maps[group_id][key])
                continue
            full = position // size
            found = manager.find_longest_cache_hit(block_hashes, full * size, [group_id], size)[0]
            if len(found) < full:
                return None
            blocks.append(found)
            source = None
            if position % size:
                source = self.pool.hash_maps[group_id].get(key)
                if source is None:
                    return None
            sources.append(source)
        return FineHit(position, tuple(blocks), tuple(sources))

    def extra_blocks(
        self,
        hits: Sequence[Sequence[KVCacheBlock]],
        sources: Sequence[KVCacheBlock | None],
        num_slots: int,
    ) -> int:
        """Fresh blocks the copies of a fine hit take beyond what its tables alone need."""
        extra = 0
        for manager, held, source in zip(self.managers, hits, sources, strict=True):
            if source is None:
                continue
            entries = cdiv(num_slots, manager.block_size)
            num_held = len(held)
            extra += (
                1
                + manager._num_fresh_blocks(entries, num_held + 1)
                - manager._num_fresh_blocks(entries, num_held)
            )
        return extra

    def adopt(self, req_id: str, sources: Sequence[KVCacheBlock | None]) -> None:
        """Append a fresh block filled from each source to the new request's tables."""
        self._resumed[req_id] = [  # only a conversation's own end: the grid is shared
            (source, source.block_hash)
            for source in sources
            if source is not None and source.block_hash in self._end_keys
        ]
        for manager, source in zip(self.managers, sources, strict=True):
            if source is None:
                continue
            (fresh,) = self.pool.get_new_blocks(1, manager.group_id)
            manager.req_to_blocks[req_id].append(fresh)
            copy = BlockCopy(manager.group_id, source.block_id, fresh.block_id)
            self._copies_before.append((req_id, copy))

    # Saving

    def wants(self, request: Request, end: int) -> bool:
        """Whether a step of the request computing up to `end` tokens reaches a checkpoint."""
        position, count = self._next.get(request.req_id, (self.unit, 0))
        if position <= min(end, request.num_prompt_tokens) and count < self.max_per_request:
            return True
        prompt_end = self._prompt_end(request)
        return request.num_computed_tokens < prompt_end <= end

    def _prompt_end(self, request: Request) -> int:
        """The last unit-grid position of the prompt (0: a prompt shorter than the unit)."""
        return request.num_prompt_tokens // self.unit * self.unit

    def plan_saves(self, request: Request, start: int, end: int) -> None:
        """Checkpoints at positions in (start, end] (prompt or outputs) for the step being
        scheduled (computing tokens [start, end)); those up to `start` (a hit) are passed."""
        req_id = request.req_id
        keys = self._request_keys(request)
        prompt_end = self._prompt_end(request)
        if start < prompt_end <= end:
            self._save(request, keys[prompt_end // self.unit - 1], prompt_end)
        position, count = self._next.get(req_id, (self.unit, 0))
        planned = []
        while position <= min(end, request.num_prompt_tokens) and count < self.max_per_request:
            if start < position != prompt_end:
                planned.append(position)
            position, count = next_position(position, self.unit), count + 1
        self._next[req_id] = (position, count)
        for position in reversed(planned):
            self._save(request, keys[position // self.unit - 1], position)

    def _save(self, request: Request, key: BlockHash, position: int) -> None:
        maps = self.pool.hash_maps
        targets = [
            m for m in self.managers if isinstance(m, MambaManager) or position % m.block_size
        ]
        if all(key in maps[m.group_id] for m in targets):
            return
        if len(targets) > self.pool.num_free_blocks - self.pool.num_blocks // FREE_SHARE_KEPT:
            return
        if len(targets) + len(self.held_blocks()) > self.max_held_blocks:
            return
        entry = _Pending(key)
        for manager in targets:
            group_id = manager.group_id
            (block,) = self.pool.get_new_blocks(1, group_id)
            entry.written.append((group_id, block))
            if isinstance(manager, MambaManager):
                save = StateSave(request.req_id, position, group_id, block.block_id)
                self._state_saves.append(save)
            else:
                table = manager.req_to_blocks[request.req_id]
                source = table[(position - 1) // manager.block_size]
                copy = BlockCopy(group_id, source.block_id, block.block_id)
                self._copies_after.append((request.req_id, copy))
        self._pending.setdefault(request.req_id, []).append(entry)

    def take_step_ops(self) -> tuple[list[BlockCopy], list[StateSave], list[BlockCopy]]:
        """(copies before the step, state saves, copies after the step) planned since the last
        call; the workers run them with the step."""
        before = [copy for _, copy in self._copies_before]
        after = [copy for _, copy in self._copies_after]
        saves = self._state_saves
        self._copies_before, self._state_saves, self._copies_after = [], [], []
        for entries in self._pending.values():
            for entry in entries:
                entry.sent = True
        return before, saves, after

    def register_written(self) -> None:
        """Make the checkpoints of the steps sent so far hit-able and evictable."""
        for req_id in list(self._pending):
            self._settle(req_id)

    def _settle(self, req_id: str) -> None:
        """Register the request's sent checkpoints; free the unsent ones unregistered."""
        kept = []
        for entry in self._pending.pop(req_id, ()):
            if not entry.sent:
                kept.append(entry)
                continue
            for group_id, block in entry.written:
                if entry.key not in self.pool.hash_maps[group_id]:
                    self.pool.cache_full_blocks([entry.key], [block], [0], group_id, 1)
                    if self.pool.offload is not None:  # found by `find` on the device only
                        self.pool.offload.keep_on_device(group_id, entry.key)
            self.pool.free_blocks([block for _, block in entry.written])
        if kept:
            self._pending[req_id] = kept

    def held_blocks(self) -> list[KVCacheBlock]:
        """Blocks of checkpoints not registered yet (one reference each; invariant checks)."""
        return [
            block
            for entries in self._pending.values()
            for entry in entries
            for _, block in entry.written
        ]

    def keep_answer_end(self, request: Request, finished: bool) -> None:
        """Before a request's blocks are freed: when it finished, register its end state at
        its computed length (if that is off the hit grid) and demote the end it resumed from."""
        req_id = request.req_id
        if not finished or req_id in self._untrusted or not self.keep_answer_ends:
            return
        position = request.num_computed_tokens
        alignment = self.managers[0].hit_alignment
        if position < self.unit or position > request.num_tokens or not position % alignment:
            return
        blocks = self._end_blocks(req_id, position)
        if blocks is None:
            return
        chain, _ = self._chains.get(req_id) or ([], [])
        extend_block_hashes(
            chain, request.cache_token_ids, self.unit, request.hash_salt, request.hash_root
        )
        index = position // self.unit - 1
        grid_key = xxhash.xxh3_128_digest(chain[index] + _TAG)
        key = end_key(grid_key, request.cache_token_ids[(index + 1) * self.unit : position])
        for group_id, block in blocks:
            self.pool.cache_full_blocks([key], [block], [0], group_id, 1)
            if self.pool.offload is not None:  # found by `find` on the device only
                self.pool.offload.keep_on_device(group_id, key)
        self.remember_end(grid_key, position, key)
        resumed = self._resumed.get(req_id, ())
        self.pool.demote([b.block_id for b, was in resumed if b.block_hash == was])

    def is_answer_end(self, key: BlockHash) -> bool:
        """Whether `key` names an answer-end checkpoint (else a unit-grid one)."""
        return key in self._end_keys

    def remember_end(self, grid_key: BlockHash, position: int, key: BlockHash) -> None:
        """Index an answer end; past twice the pool's blocks, drop the evicted ones first (at
        most one end per pool block is registered at a time)."""
        if len(self._end_keys) >= 2 * self.pool.num_blocks:
            state_map = self.pool.hash_maps[self.state_groups[0]]
            for grid, ends in list(self._ends.items()):
                for place, end in list(ends.items()):
                    if end not in state_map:
                        del ends[place]
                        self._end_keys.discard(end)
                if not ends:
                    del self._ends[grid]
        self._ends.setdefault(grid_key, {})[position] = key
        self._end_keys.add(key)

    def _end_blocks(self, req_id: str, position: int) -> list[tuple[int, KVCacheBlock]] | None:
        """Per group, the block holding the request's state (or its partial attention block)
        at `position`; None when one is missing or already registered."""
        found = []
        for manager in self.managers:
            table = manager.req_to_blocks.get(req_id, [])
            if isinstance(manager, MambaManager):  # the state after the last step's tokens
                index = (position - 1) // manager.block_size
                if index >= len(table):
                    return None
                block = table[index]
            elif position % manager.block_size:
                index = position // manager.block_size
                if index >= len(table):
                    return None
                block = table[index]
            else:
                continue
            if block is self.pool.null_block or block.block_hash is not None:
                return None
            found.append((manager.group_id, block))
        return found

    def forget(self, req_id: str, keep_sent: bool = True) -> None:
        """Drop a request's state (finished or preempted): its checkpoints whose ops were sent
        are registered (unless `keep_sent` is False: a failed step); the others are freed
        unregistered and their ops dropped (their blocks may go to another request in this
        very step)."""
        self._copies_before = [op for op in self._copies_before if op[0] != req_id]
        self._copies_after = [op for op in self._copies_after if op[0] != req_id]
        self._state_saves = [op for op in self._state_saves if op.req_id != req_id]
        self._chains.pop(req_id, None)
        self._next.pop(req_id, None)
        self._resumed.pop(req_id, None)
        if keep_sent:  # the request is freed (`keep_answer_end` has run)
            self._settle(req_id)
            self._untrusted.discard(req_id)
        else:
            self._untrusted.add(req_id)
        unsent = self._pending.pop(req_id, ())
        self.pool.free_blocks([block for entry in unsent for _, block in entry.written])

"""Draft-position states of recurrent groups under speculative decoding.

A verify step computes a request's last token and its k drafts in one go; a recurrent layer
(Mamba-2, gated DeltaNet, short conv) ends the step holding the state after the last draft. So
that rejecting drafts is a choice of state, not a recompute, each running request that drafts
holds k extra state blocks per recurrent group (from the shared pool, counted like any block):

    verify step at c computed, drafts d1..dk     slot j <- state after token c + j   (j < k)
                                                 table  <- state after token c + k   (as usual)
    a drafts accepted (a < k)                    copy slot a -> the table's running state block

The slots are never hashed nor cached: the prefix cache only ever sees states at accepted
positions.
"""

from __future__ import annotations

from scheduler.kv_cache.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_cache.mamba_manager import MambaManager
from scheduler.kv_cache.spec import MambaCacheMode
from scheduler.output import BlockCopy, StateSave


class SpecStateSlots:
    """The k draft-state blocks per recurrent group of each drafting request."""

    def __init__(self, managers: list[MambaManager], pool: BlockPool, num_slots: int) -> None:
        self.managers = managers
        self.pool = pool
        self.num_slots = num_slots
        self._slots: dict[str, list[list[KVCacheBlock]]] = {}
        """Per request, per recurrent group: its `num_slots` blocks."""
        self._copies: dict[str, list[BlockCopy]] = {}
        self._saves: dict[str, list[StateSave]] = {}
        """Worker ops planned for the step being scheduled, by request (dropped with it)."""

    @property
    def num_blocks_per_request(self) -> int:
        """Pool blocks one drafting request holds beyond its tables."""
        return self.num_slots * len(self.managers)

    def reserve(self, req_id: str) -> bool:
        """Make sure `req_id` holds its slots; False (nothing taken) when the pool is short."""
        if req_id in self._slots:
            return True
        if self.pool.num_free_blocks < self.num_blocks_per_request:
            return False
        self._slots[req_id] = [
            self.pool.get_new_blocks(self.num_slots, manager.group_id) for manager in self.managers
        ]
        return True

    def plan_saves(self, req_id: str, num_computed: int, num_drafts: int) -> None:
        """The verify step keeps the state after each of its first `num_drafts` tokens."""
        self._saves[req_id] = [
            StateSave(req_id, num_computed + 1 + index, manager.group_id, slots[index].block_id)
            for manager, slots in zip(self.managers, self._slots[req_id], strict=True)
            for index in range(num_drafts)
        ]

    def restore(self, req_id: str, num_accepted: int, num_computed: int) -> None:
        """After `num_accepted` drafts were accepted (fewer than verified) and computed tokens
        rolled back to `num_computed`: copy the accepted position's slot onto the block the next
        step reads the running state from (before that step)."""
        copies = self._copies.setdefault(req_id, [])
        for manager, slots in zip(self.managers, self._slots[req_id], strict=True):
            table = manager.req_to_blocks[req_id]
            index = (
                0
                if manager.mode is MambaCacheMode.NONE
                else (num_computed - 1) // (manager.block_size)
            )
            target = table[index]
            assert target is not self.pool.null_block, "running state entry is null"
            copies.append(
                BlockCopy(manager.group_id, slots[num_accepted].block_id, target.block_id)
            )

    def take_ops(self) -> tuple[list[BlockCopy], list[StateSave]]:
        """(copies before the step, state saves) planned since the last call."""
        copies = [copy for per_request in self._copies.values() for copy in per_request]
        saves = [save for per_request in self._saves.values() for save in per_request]
        self._copies, self._saves = {}, {}
        return copies, saves

    def window_tokens(self, num_computed: int) -> int:
        """Most tokens a verify step from `num_computed` may compute so that, in every recurrent
        group keeping states at block ends, it stays inside one block and stops short of the
        block's last token: that token is computed by a plain step, so block-end states are
        written and registered exactly as without speculation (cached states and hits are
        unchanged). At least 1 (the plain step)."""
        limits = [
            manager.block_size - num_computed % manager.block_size - 1
            for manager in self.managers
            if manager.mode is not MambaCacheMode.NONE
        ]
        return max(1, min(limits, default=self.num_slots + 1))

    def release(self, req_id: str) -> bool:
        """Give a running request's slots back to make room (False: it held none). A restore
        copy already planned stays: copies from slots run first among the step's copies, so
        the state is read before the block can be written again."""
        slots = self._slots.pop(req_id, None)
        for per_group in slots or ():
            self.pool.free_blocks(per_group)
        return slots is not None

    def free(self, req_id: str) -> None:
        """Give a finished or preempted request's slots back; its planned ops are dropped
        (its blocks may go to another request in this very step)."""
        self._copies.pop(req_id, None)
        self._saves.pop(req_id, None)
        for slots in self._slots.pop(req_id, ()):
            self.pool.free_blocks(slots)

    def held_blocks(self) -> list[KVCacheBlock]:
        """Every slot block (one reference each; invariant checks)."""
        return [
            block for per_group in self._slots.values() for slots in per_group for block in slots
        ]

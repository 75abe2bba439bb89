"""The offload tier below the device pool: the scheduler's index of KV blocks kept in host memory
and, below it, on local disk.

Keys are per group, (group id, block hash), as in the device pool. A block enters the tier when the
device pool evicts it (`BlockPool.get_new_blocks`), so the tier holds exactly what the device pool
registered: every block of a full-attention chain, the window blocks a later hit point can reach,
recurrent states at hit-aligned ends, and the KV of donor layers only (sharing layers own no
memory). Lookups see device ∪ host ∪ disk (`DeviceOrOffloaded`); the fixed point over the groups
is the coordinator's own, so a hit may be partly on the device and partly in the tier.

    device evicts (group, hash) ─► offer ─► OffloadStore(slot, group, block): device → host
    host full                   ─► first to go ─► OffloadSpill(slot, file): host → disk (or dropped)
    disk full                   ─► first to go ─► its file in `disk_drops`
    hit holds an OffloadedBlock ─► fill ─► OffloadLoad(req, slot | file, group, block) → device

Which entry goes first is the level's eviction order (`scheduler.kv_cache.offload_eviction`):
a hit cut short by an entry the tier gave up for room (`note_hit_end`) has its request's chain
protected (`protect`). Entries read by pending loads are never evicted. A loading request's
fresh blocks are registered in the device pool when the workers report the load done
(`finish`); a failed load drops the entries it read (a corrupt file included), so the retry
recomputes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Protocol

from scheduler.block_hash import BlockHash
from scheduler.config import OffloadConfig
from scheduler.kv_cache.events import KVEventSink
from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.eviction_history import EvictionHistory
from scheduler.kv_cache.free_block_queue import KVCacheBlock
from scheduler.kv_cache.offload_eviction import Key
from scheduler.kv_cache.offload_levels import (
    DeviceOrOffloaded,
    OffloadedBlock,
    TierLevel,
    disk_file_name,
    group_block_bytes,
    layout_fingerprint,
    scan_disk_folder,
)
from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.output import OffloadLoad, OffloadOps, OffloadSpill, OffloadStore

__all__ = ["DeviceOrOffloaded", "DevicePool", "OffloadIndex", "OffloadedBlock", "group_block_bytes"]


THRASH_LOOKAHEAD = 8
"""Hash blocks after a tier hit that show whether the tier gave the hit's continuation up."""


class PendingLoad(NamedTuple):
    """A load in flight: the tier entry read and the device block it fills."""

    source: OffloadedBlock
    block: KVCacheBlock


class DiskTier(NamedTuple):
    """Where and how large the disk level is."""

    folder: str
    """The fingerprint folder: `kv_offloading_dir/<fingerprint>`."""
    capacity_bytes: int


class DevicePool(Protocol):
    """What the tier asks of the device pool it sits below (`BlockPool`, which imports this
    module: the pool calls the tier, the tier names only this)."""

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None: ...

    def get_new_blocks(self, count: int, group_id: int) -> list[KVCacheBlock]: ...

    def register_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None: ...


class OffloadCounters(NamedTuple):
    """Usage now and cumulative counters of the tier (never reset on read)."""

    used_bytes: int
    capacity_bytes: int
    num_blocks: int
    """Host entries held now."""
    stored_bytes: int
    loaded_bytes: int
    group_hit_tokens: tuple[int, ...]
    """Per group, tokens of admitted hits served by blocks loaded from the tier."""
    num_failed_loads: int
    disk_used_bytes: int = 0
    disk_capacity_bytes: int = 0
    disk_num_blocks: int = 0
    disk_loaded_bytes: int = 0
    disk_stored_bytes: int = 0
    """Bytes written to the disk level (host entries it took over)."""
    disk_group_hit_tokens: tuple[int, ...] = ()
    """Per group, the part of `group_hit_tokens` served from the disk level."""


class OffloadIndex:
    """The tier's keys, slots, files and budgets; emits the copies the workers run."""

    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: Sequence[int],
        block_sizes: Sequence[int],
        disk: DiskTier | None = None,
        policy: EvictionPolicy = EvictionPolicy.CHAIN,
    ) -> None:
        self.host = TierLevel(capacity_bytes, block_bytes, policy)
        self.disk = TierLevel(disk.capacity_bytes if disk else 0, block_bytes, policy)
        self.folder = disk.folder if disk else None
        self.block_bytes = tuple(block_bytes)
        self.block_sizes = tuple(block_sizes)
        self.maps = (self.host.maps, self.disk.maps)
        """Per level, per group: hash -> entry."""
        self._pending: dict[str, list[PendingLoad]] = {}
        self._thrashed: set[str] = set()
        """Requests whose hit the tier cut short by giving blocks up for room (`note_hit_end`)."""
        self._pinned: dict[Key, int] = {}
        """Entries read by pending loads (never evicted before the load ends), with a count."""
        self._to_fill: list[tuple[str, list[KVCacheBlock], int]] = []
        """Table entries adopted from the tier that `fill` has not given a device block yet."""
        self._next_slot = 1
        self._ops = _OpLists()
        self.stored_bytes = self.loaded_bytes = self.disk_loaded_bytes = 0
        self.disk_stored_bytes = 0
        self.num_failed_loads = 0
        self._group_hit_tokens = [0] * len(self.block_bytes)
        self._disk_group_hit_tokens = [0] * len(self.block_bytes)
        self.event_sink: KVEventSink | None = None
        """Told when a key enters or leaves the tier (KV events); None: off."""
        self._device_only: set[Key] = set()
        """Registered keys no tier lookup reads (state checkpoints): not stored when evicted."""
        self.evicted = EvictionHistory(
            max(1, capacity_bytes // max(1, min(block_bytes, default=1)))
        )
        """Keys the tier gave up for room lately: a hit cut short by one shows it thrashes."""
        if self.folder is not None:
            self._find_files(self.folder)

    def _find_files(self, folder: str) -> None:
        """Adopt the block files a previous engine of this fingerprint left, newest first while
        they fit (the others are deleted)."""
        for found in reversed(scan_disk_folder(folder, len(self.block_bytes))):
            self._next_slot = max(self._next_slot, found.slot + 1)  # new names never clash
            path = os.path.join(folder, found.name)
            size = self.block_bytes[found.key[0]]
            if found.key in self.disk or self.disk.used_bytes + size > self.disk.capacity_bytes:
                self._ops.disk_drops.append(path)  # an older copy, or no room: deleted
                continue
            self.disk.add(OffloadedBlock(found.key, None, path), oldest=True)

    def keep_on_device(self, group_id: int, block_hash: BlockHash) -> None:
        """A key only device lookups read (a state checkpoint): its eviction stores nothing."""
        self._device_only.add((group_id, block_hash))

    def offer(self, group_id: int, block_hash: BlockHash, block_id: int, stamp: int = -1) -> None:
        """The device pool evicts this registered block (of its chain `stamp`, -1: none): keep
        a copy unless the tier has one."""
        key = (group_id, block_hash)
        if self._device_only and key in self._device_only:
            self._device_only.discard(key)
            return
        for level in (self.host, self.disk):
            if key in level:
                level.order.touch(key, stamp)
                return
        if not self._make_room(self.host, self.block_bytes[group_id]):
            return
        entry = OffloadedBlock(key, self._next_slot)
        self._next_slot += 1
        self.host.add(entry, stamp=stamp)
        if self.event_sink is not None:
            self.event_sink.tier_stored(group_id, block_hash)
        self.stored_bytes += self.block_bytes[group_id]
        self._ops.stores.append(OffloadStore(self._next_slot - 1, group_id, block_id))

    def _make_room(self, level: TierLevel, size: int) -> bool:
        victims = level.victims(size, self._pinned)
        if victims is None:
            return False
        for key in victims:
            self._evict(level, key)
        return True

    def _evict(self, level: TierLevel, key: Key) -> None:
        """Out of `level`: a host entry moves to disk when there is one, else is forgotten."""
        if level is self.disk or self.folder is None:
            self.evicted.record_all([key])
            self._evict_for_good(level, key)
            return
        entry = level.remove(key)
        assert entry.slot is not None
        self._ops.drops.append(entry.slot)
        if not self._make_room(self.disk, self.block_bytes[key[0]]):
            self.evicted.record_all([key])
            self._forgotten(key)
            return
        entry.file = os.path.join(self.folder, disk_file_name(key, entry.slot))
        self._ops.spills.append(OffloadSpill(entry.slot, entry.file))
        self.disk_stored_bytes += self.block_bytes[key[0]]
        entry.slot = None
        self.disk.add(entry)

    def adopt(self, pool: DevicePool, table: list[KVCacheBlock], start: int, req_id: str) -> None:
        """A new table starts from a hit (entries from `start` on): touch its device blocks and
        keep its tier entries (no eviction) until `fill` gives them device blocks."""
        device = []
        for index in range(start, len(table)):
            block = table[index]
            if isinstance(block, OffloadedBlock):
                self._pinned[block.key] = self._pinned.get(block.key, 0) + 1
                self._to_fill.append((req_id, table, index))
            else:
                device.append(block)
        pool.touch(device)

    def fill(self, pool: DevicePool) -> None:
        """Give every adopted tier entry a fresh device block (in its table) and a load; call
        once every group of the request adopted its hit, so no pop evicts one of its blocks."""
        for req_id, table, index in self._to_fill:
            source = table[index]
            assert isinstance(source, OffloadedBlock)
            (fresh,) = pool.get_new_blocks(1, source.group_id)
            table[index] = fresh
            self._pending.setdefault(req_id, []).append(PendingLoad(source, fresh))
            load = OffloadLoad(req_id, source.group_id, fresh.block_id, source.slot, source.file)
            self._ops.loads.append(load)
        self._to_fill.clear()

    def is_loading(self, req_id: str) -> bool:
        """Whether the request waits for loads from the tier."""
        return req_id in self._pending

    def finish(self, pool: DevicePool, req_id: str, succeeded: bool) -> None:
        """The workers ended the request's loads: register the filled blocks in the device pool,
        or, after a failure, drop the entries read (their blocks stay unregistered)."""
        for source, block in self._pending.pop(req_id, ()):
            self._unpin(source.key)
            level = self.disk if source.file is not None else self.host
            if not succeeded:
                if level.entries.get(source.key) is source:
                    self._evict_for_good(level, source.key)
                continue
            size = self.block_bytes[source.group_id]
            self.loaded_bytes += size
            tokens = self.block_sizes[source.group_id]
            if source.file is not None:
                self.disk_loaded_bytes += size
                self._disk_group_hit_tokens[source.group_id] += tokens
            self._group_hit_tokens[source.group_id] += tokens
            pool.register_block(block, source.key[1])
        if not succeeded:
            self.num_failed_loads += 1

    def note_hit_end(
        self, req_id: str, block_hashes: Sequence[BlockHash], num_hit_blocks: int
    ) -> None:
        """A lookup's hit ended after `num_hit_blocks` of the request's `block_hashes`: when the
        tier gave one of the next few up for room lately, it thrashes on that session, and
        the chain the request frees is protected (`scheduler.kv_cache.offload_eviction`)."""
        next_hashes = block_hashes[num_hit_blocks : num_hit_blocks + THRASH_LOOKAHEAD]
        if any(self.evicted.was_evicted_anywhere(h) for h in next_hashes):
            self._thrashed.add(req_id)

    def protect_if_thrashed(self, req_id: str, stamp: int | None) -> None:
        """The request just freed its blocks (device chain `stamp`, None without the `chain`
        policy): when the tier thrashed on it, that chain's blocks are kept as one chain."""
        if req_id in self._thrashed:
            self._thrashed.discard(req_id)
            if stamp is not None:
                self.host.order.protect(stamp)

    def _evict_for_good(self, level: TierLevel, key: Key) -> None:
        entry = level.remove(key)
        if entry.file is not None:
            self._ops.disk_drops.append(entry.file)
        elif entry.slot is not None:
            self._ops.drops.append(entry.slot)
        self._forgotten(key)

    def _forgotten(self, key: Key) -> None:
        if self.event_sink is not None:
            self.event_sink.tier_removed(*key)

    def cancel(self, req_id: str) -> None:
        """The request left while loading: its loads count for nothing."""
        for source, _ in self._pending.pop(req_id, ()):
            self._unpin(source.key)

    def _unpin(self, key: Key) -> None:
        count = self._pinned.pop(key) - 1
        if count:
            self._pinned[key] = count

    def take_ops(self) -> OffloadOps:
        """The copies and drops of the step being scheduled (the lists start over)."""
        ops, self._ops = self._ops, _OpLists()
        return OffloadOps(
            tuple(ops.stores),
            tuple(ops.loads),
            tuple(ops.drops),
            tuple(ops.spills),
            tuple(ops.disk_drops),
        )

    def clear(self) -> None:
        """Forget every entry not read by a pending load, on disk too (a prefix-cache reset)."""
        self._device_only.clear()
        for level in (self.host, self.disk):
            for key in [key for key in level.entries if key not in self._pinned]:
                self._evict_for_good(level, key)

    def counters(self) -> OffloadCounters:
        return OffloadCounters(
            used_bytes=self.host.used_bytes,
            capacity_bytes=self.host.capacity_bytes,
            num_blocks=len(self.host),
            stored_bytes=self.stored_bytes,
            loaded_bytes=self.loaded_bytes,
            group_hit_tokens=tuple(self._group_hit_tokens),
            num_failed_loads=self.num_failed_loads,
            disk_used_bytes=self.disk.used_bytes,
            disk_capacity_bytes=self.disk.capacity_bytes,
            disk_num_blocks=len(self.disk),
            disk_loaded_bytes=self.disk_loaded_bytes,
            disk_stored_bytes=self.disk_stored_bytes,
            disk_group_hit_tokens=tuple(self._disk_group_hit_tokens),
        )

    def check_invariants(self) -> None:
        """Bytes and maps agree with the entries; no key in two levels (tests)."""
        for level in (self.host, self.disk):
            level.check()
            assert level.used_bytes <= level.capacity_bytes or self._pinned
        assert not set(self.host.entries) & set(self.disk.entries)


def count_offloaded(blocks: Sequence[Sequence[KVCacheBlock]]) -> int:
    """Blocks of a hit (one list per group) held in the tier."""
    return sum(isinstance(block, OffloadedBlock) for group in blocks for block in group)


def build_offload_index(kv_config: KVCacheConfig, config: OffloadConfig) -> OffloadIndex:
    """The tier `config` describes for this KV layout (its disk level in the folder of the
    layout's fingerprint)."""
    disk = None
    if config.disk_dir and config.disk_bytes:
        fingerprint = layout_fingerprint(kv_config, config.model_id)
        disk = DiskTier(os.path.join(config.disk_dir, fingerprint), config.disk_bytes)
    block_bytes = group_block_bytes(kv_config)
    return OffloadIndex(
        config.host_bytes, block_bytes, kv_config.block_sizes, disk, config.eviction
    )


class _OpLists:
    __slots__ = ("disk_drops", "drops", "loads", "spills", "stores")

    def __init__(self) -> None:
        self.stores: list[OffloadStore] = []
        self.loads: list[OffloadLoad] = []
        self.drops: list[int] = []
        self.spills: list[OffloadSpill] = []
        self.disk_drops: list[str] = []

"""The offload tier below the device pool: the scheduler's index of KV blocks kept in host memory.

Keys are per group, (group id, block hash), as in the device pool. A block enters the tier when the
device pool evicts it (`BlockPool.get_new_blocks`), so the tier holds exactly what the device pool
registered: every block of a full-attention chain, the window blocks a later hit point can reach,
recurrent states at hit-aligned ends, and the KV of donor layers only (sharing layers own no
memory). Lookups see device ∪ tier through `DeviceOrOffloaded`; the fixed point over the groups is
the coordinator's own, so a hit may be partly on the device and partly in the tier.

    device evicts (group, hash) ─► offer ─► OffloadStore(slot, group, block): device → host
    hit holds an OffloadedBlock ─► fill ─► OffloadLoad(req, slot, group, block): host → device
    tier full                   ─► LRU entry out (pending loads kept) ─► slot in `drops`

A loading request's fresh blocks are registered in the device pool when the workers report the
load done (`finish`); a failed load drops the tier entries it read, so the retry recomputes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.free_block_queue import KVCacheBlock
from scheduler.kv_cache.spec import KVCacheConfig
from scheduler.output import OffloadLoad, OffloadOps, OffloadStore

if TYPE_CHECKING:
    from scheduler.kv_cache.block_pool import BlockPool


class OffloadedBlock(KVCacheBlock):
    """A lookup result held in the tier, not on the device: `slot` names its host copy."""

    __slots__ = ("key", "slot")

    def __init__(self, group_id: int, block_hash: BlockHash, slot: int) -> None:
        super().__init__(-1)  # never sent to a worker: `fill` swaps it for a device block
        self.group_id = group_id
        self.block_hash = block_hash
        self.key = (group_id, block_hash)
        self.slot = slot


class PendingLoad(NamedTuple):
    """A load in flight: the tier entry read and the device block it fills."""

    source: OffloadedBlock
    block: KVCacheBlock


class DeviceOrOffloaded(Mapping[BlockHash, KVCacheBlock]):
    """One group's lookup map: the device block under a hash, else its tier entry."""

    __slots__ = ("_device", "_offloaded")

    def __init__(
        self, device: dict[BlockHash, KVCacheBlock], offloaded: dict[BlockHash, OffloadedBlock]
    ) -> None:
        self._device = device
        self._offloaded = offloaded

    def get(self, key: BlockHash, default: KVCacheBlock | None = None) -> KVCacheBlock | None:  # type: ignore[override]
        block = self._device.get(key)
        if block is not None:
            return block
        return self._offloaded.get(key, default)

    def __getitem__(self, key: BlockHash) -> KVCacheBlock:
        block = self.get(key)
        if block is None:
            raise KeyError(key)
        return block

    def __contains__(self, key: object) -> bool:
        return key in self._device or key in self._offloaded

    def __iter__(self) -> Iterator[BlockHash]:
        yield from self._device
        yield from (key for key in self._offloaded if key not in self._device)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def group_block_bytes(config: KVCacheConfig) -> tuple[int, ...]:
    """Bytes one block of each group holds over the group's layers that own memory; 1 per group
    for a config without a tensor plan (a replay: the tier is then sized in blocks)."""
    if not config.tensors:
        return (1,) * len(config.groups)
    group_of = {name: gid for gid, group in enumerate(config.groups) for name in group.layer_names}
    out = [0] * len(config.groups)
    for tensor in config.tensors:
        page = tensor.size_bytes // config.num_blocks
        for name in tensor.shared_by:
            out[group_of[name]] += page
    return tuple(out)


class OffloadCounters(NamedTuple):
    """Cumulative counters of the tier (never reset on read)."""

    used_bytes: int
    capacity_bytes: int
    num_blocks: int
    """Entries held now."""
    stored_bytes: int
    loaded_bytes: int
    group_hit_tokens: tuple[int, ...]
    """Per group, tokens of admitted hits served by blocks loaded from the tier."""
    num_failed_loads: int


class OffloadIndex:
    """The tier's keys, slots and budget; emits the copies the workers run."""

    def __init__(self, capacity_bytes: int, block_bytes: Sequence[int], block_sizes: Sequence[int]):
        if capacity_bytes < 0:
            raise ValueError(f"offload capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_bytes = tuple(block_bytes)
        self.block_sizes = tuple(block_sizes)
        self.maps: list[dict[BlockHash, OffloadedBlock]] = [{} for _ in block_bytes]
        """Per group: hash -> tier entry."""
        self._lru: OrderedDict[tuple[int, BlockHash], OffloadedBlock] = OrderedDict()
        self._pending: dict[str, list[PendingLoad]] = {}
        self._pinned: dict[tuple[int, BlockHash], int] = {}
        """Entries read by pending loads (never evicted before the load ends), with a count."""
        self._to_fill: list[tuple[str, list[KVCacheBlock], int]] = []
        """Table entries adopted from the tier that `fill` has not given a device block yet."""
        self._next_slot = 1
        self.used_bytes = 0
        self._ops = _OpLists([], [], [])
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.num_failed_loads = 0
        self._group_hit_tokens = [0] * len(self.block_bytes)

    def offer(self, group_id: int, block_hash: BlockHash, block_id: int) -> None:
        """The device pool evicts this registered block: keep a copy unless the tier has one."""
        key = (group_id, block_hash)
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        size = self.block_bytes[group_id]
        if not self._make_room(size):
            return
        entry = OffloadedBlock(group_id, block_hash, self._next_slot)
        self._next_slot += 1
        self._lru[key] = entry
        self.maps[group_id][block_hash] = entry
        self.used_bytes += size
        self.stored_bytes += size
        self._ops.stores.append(OffloadStore(entry.slot, group_id, block_id))

    def _make_room(self, size: int) -> bool:
        """Drop least recently used entries (not those pending loads read) until `size` fits."""
        if size > self.capacity_bytes:
            return False
        victims = iter(list(self._lru))
        while self.used_bytes + size > self.capacity_bytes:
            key = next(victims, None)
            if key is None:
                return False
            if key not in self._pinned:
                self._remove(key)
        return True

    def _remove(self, key: tuple[int, BlockHash]) -> None:
        entry = self._lru.pop(key)
        del self.maps[key[0]][key[1]]
        self.used_bytes -= self.block_bytes[key[0]]
        self._ops.drops.append(entry.slot)

    def adopt(self, pool: BlockPool, table: list[KVCacheBlock], start: int, req_id: str) -> None:
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

    def fill(self, pool: BlockPool) -> None:
        """Give every adopted tier entry a fresh device block (in its table) and a load; call
        once every group of the request adopted its hit, so no pop evicts one of its blocks."""
        for req_id, table, index in self._to_fill:
            source = table[index]
            assert isinstance(source, OffloadedBlock)
            (fresh,) = pool.get_new_blocks(1, source.group_id)
            table[index] = fresh
            self._pending.setdefault(req_id, []).append(PendingLoad(source, fresh))
            self._ops.loads.append(
                OffloadLoad(req_id, source.slot, source.group_id, fresh.block_id)
            )
        self._to_fill.clear()

    def is_loading(self, req_id: str) -> bool:
        """Whether the request waits for loads from the tier."""
        return req_id in self._pending

    def finish(self, pool: BlockPool, req_id: str, succeeded: bool) -> None:
        """The workers ended the request's loads: register the filled blocks in the device pool,
        or, after a failure, drop the entries read (their blocks stay unregistered)."""
        for source, block in self._pending.pop(req_id, ()):
            self._unpin(source.key)
            if not succeeded:
                if self._lru.get(source.key) is source:
                    self._remove(source.key)
                continue
            self.loaded_bytes += self.block_bytes[source.group_id]
            self._group_hit_tokens[source.group_id] += self.block_sizes[source.group_id]
            pool.register_block(block, source.key[1])
        if not succeeded:
            self.num_failed_loads += 1

    def cancel(self, req_id: str) -> None:
        """The request left while loading: its loads count for nothing."""
        for source, _ in self._pending.pop(req_id, ()):
            self._unpin(source.key)

    def _unpin(self, key: tuple[int, BlockHash]) -> None:
        count = self._pinned.pop(key) - 1
        if count:
            self._pinned[key] = count

    def take_ops(self) -> OffloadOps:
        """The copies and drops of the step being scheduled (the lists start over)."""
        ops, self._ops = self._ops, _OpLists([], [], [])
        return OffloadOps(tuple(ops.stores), tuple(ops.loads), tuple(ops.drops))

    def clear(self) -> None:
        """Forget every entry not read by a pending load (a prefix-cache reset)."""
        for key in [key for key in self._lru if key not in self._pinned]:
            self._remove(key)

    def counters(self) -> OffloadCounters:
        return OffloadCounters(
            used_bytes=self.used_bytes,
            capacity_bytes=self.capacity_bytes,
            num_blocks=len(self._lru),
            stored_bytes=self.stored_bytes,
            loaded_bytes=self.loaded_bytes,
            group_hit_tokens=tuple(self._group_hit_tokens),
            num_failed_loads=self.num_failed_loads,
        )

    def check_invariants(self) -> None:
        """Bytes and maps agree with the entries (tests)."""
        assert self.used_bytes == sum(self.block_bytes[g] for g, _ in self._lru)
        assert self.used_bytes <= self.capacity_bytes or self._pinned
        assert sum(map(len, self.maps)) == len(self._lru)


class _OpLists(NamedTuple):
    stores: list[OffloadStore]
    loads: list[OffloadLoad]
    drops: list[int]

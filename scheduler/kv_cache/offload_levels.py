"""The levels of the offload tier (host memory, local disk): entries, budgets and LRU order.

`scheduler.kv_cache.offload` drives two `TierLevel`s; this module knows no ops, and
`scheduler.kv_cache.offload_eviction` their eviction order. A disk level's
entries are files named after their key and the host slot they came from (a name is never
reused, so writing one entry never meets deleting another), `g<group>-<hash hex>-<slot>.kv`,
in a folder named after the
fingerprint of the model, KV layout and dtype, so a restarted engine of the same model finds
them again (`scan_disk_folder`) and another model's never mix with them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import xxhash

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.eviction import EvictionPolicy
from scheduler.kv_cache.free_block_queue import KVCacheBlock
from scheduler.kv_cache.offload_eviction import EntryOrder, Key
from scheduler.kv_cache.spec import KVCacheConfig

_FILE_NAME = re.compile(r"^g(\d+)-([0-9a-f]+)-(\d+)\.kv$")


class OffloadedBlock(KVCacheBlock):
    """A lookup result held in the tier, not on the device: in host memory at `slot`, or on disk
    in `file` (exactly one of them is set)."""

    __slots__ = ("file", "key", "slot")

    def __init__(self, key: Key, slot: int | None, file: str | None = None) -> None:
        super().__init__(-1)  # never sent to a worker: `fill` swaps it for a device block
        self.group_id, self.block_hash = key
        self.key = key
        self.slot = slot
        self.file = file


class TierLevel:
    """One level: entries by key within a byte budget, in the eviction order of `policy`
    (`scheduler.kv_cache.offload_eviction`)."""

    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: Sequence[int],
        policy: EvictionPolicy = EvictionPolicy.CHAIN,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"offload capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.block_bytes = tuple(block_bytes)
        self.maps: list[dict[BlockHash, OffloadedBlock]] = [{} for _ in block_bytes]
        """Per group: hash -> entry (what lookups read)."""
        self.entries: dict[Key, OffloadedBlock] = {}
        self.order = EntryOrder(policy, capacity_bytes)
        self.used_bytes = 0

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def can_hold(self, group_id: int) -> bool:
        return self.block_bytes[group_id] <= self.capacity_bytes

    def add(self, entry: OffloadedBlock, oldest: bool = False, stamp: int = -1) -> None:
        """Hold `entry`, most recently used (or, `oldest`, first to go), evicted from device
        chain `stamp` (-1: none)."""
        size = self.block_bytes[entry.key[0]]
        self.entries[entry.key] = entry
        self.order.add(entry.key, size, oldest, stamp)
        self.maps[entry.key[0]][entry.key[1]] = entry
        self.used_bytes += size

    def remove(self, key: Key) -> OffloadedBlock:
        entry = self.entries.pop(key)
        self.order.discard(key)
        del self.maps[key[0]][key[1]]
        self.used_bytes -= self.block_bytes[key[0]]
        return entry

    def victims(self, size: int, pinned: Mapping[Key, int]) -> list[Key] | None:
        """Keys (not pinned) whose removal makes room for `size` bytes, first to go first;
        None when even all of them would not."""
        if size > self.capacity_bytes:
            return None
        needed = self.used_bytes + size - self.capacity_bytes
        return self.order.victims(needed, self.block_bytes, pinned)

    def check(self) -> None:
        assert self.used_bytes == sum(self.block_bytes[group] for group, _ in self.entries)
        assert sum(map(len, self.maps)) == len(self.entries)
        assert sorted(self.order.in_eviction_order()) == sorted(self.entries)


class DeviceOrOffloaded(Mapping[BlockHash, KVCacheBlock]):
    """One group's lookup map: the device block under a hash, else its host or disk entry."""

    __slots__ = ("_device", "_levels")

    def __init__(
        self,
        device: Mapping[BlockHash, KVCacheBlock],
        levels: Sequence[Mapping[BlockHash, KVCacheBlock]],
    ) -> None:
        self._device = device
        self._levels = tuple(levels)

    def get(self, key: BlockHash, default: KVCacheBlock | None = None) -> KVCacheBlock | None:  # type: ignore[override]
        block = self._device.get(key)
        if block is not None:
            return block
        for level in self._levels:
            entry = level.get(key)
            if entry is not None:
                return entry
        return default

    def __getitem__(self, key: BlockHash) -> KVCacheBlock:
        block = self.get(key)
        if block is None:
            raise KeyError(key)
        return block

    def __iter__(self) -> Iterator[BlockHash]:
        seen = set(self._device)
        yield from self._device
        for level in self._levels:
            for key in level:
                if key not in seen:
                    seen.add(key)
                    yield key

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


def layout_fingerprint(config: KVCacheConfig, model_id: str) -> str:
    """Names the model, its KV layout (groups, specs, dtypes, pages) and nothing else."""
    layout = repr((model_id, config.groups, config.tensors and group_block_bytes(config)))
    return xxhash.xxh3_64_hexdigest(layout.encode())


def disk_file_name(key: Key, slot: int) -> str:
    return f"g{key[0]}-{key[1].hex()}-{slot}.kv"


class FoundFile(NamedTuple):
    """A block file a previous engine left."""

    key: Key
    slot: int
    name: str


def scan_disk_folder(folder: str, num_groups: int) -> list[FoundFile]:
    """The block files a previous engine left in `folder`, oldest first (other files are left
    alone)."""
    if not os.path.isdir(folder):
        return []
    found: list[tuple[float, FoundFile]] = []
    with os.scandir(folder) as entries:
        for entry in entries:
            match = _FILE_NAME.match(entry.name)
            if match is None or int(match[1]) >= num_groups:
                continue
            key = (int(match[1]), bytes.fromhex(match[2]))
            found.append((entry.stat().st_mtime, FoundFile(key, int(match[3]), entry.name)))
    return [file for _, file in sorted(found)]

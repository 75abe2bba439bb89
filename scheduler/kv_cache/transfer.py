"""The scheduler's side of a KV transfer between two engines: which blocks a prefix needs, which
of them the receiver already holds, and the receiver's adoption of the rest.

The set sent is the hybrid minimum a prefix hit reads, found by the coordinator's own fixed point
on the sender: every full-attention block, only the window / chunk blocks the hit reaches, one
recurrent state at the hit's aligned end; KV-sharing layers own no blocks. Where the sender's
own lookup of the prompt resumes further, at a state checkpoint (a prompt or answer end on the
prefix-match grid), that checkpoint's blocks travel too, under its key, so the receiver's lookup
resumes there as well. Keys are per group, (group id, block hash), as in the pool and the
offload tier, so both engines must hash alike (same model, block sizes and layout:
`transfer_fingerprint`, which leaves out the per-rank sizes tensor parallelism divides: the
receiver's workers reshard). The sender's hit reaches into its offload tier: blocks only the tier
holds are sent from there (`TierPage`), never recomputed.

    receiver  held_keys(prompt)            ─► HeldKeys (per group: hashes it has)
    sender    find_export(prompt, held)    ─► TransferKeys + sender block ids (workers export)
    receiver  reserve_import(keys)         ─► fresh blocks (workers import the pages)
    receiver  commit_import / abort_import ─► blocks registered (cached, evictable) / freed
    sender    demote_export(plan)          ─► (a conversation moved) its sent blocks are
                                               evicted first, making room where it left
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.checkpoints import checkpoint_keys
from scheduler.kv_cache.free_block_queue import KVCacheBlock
from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.offload_levels import (
    OffloadedBlock,
    group_block_bytes,
    layout_fingerprint,
)
from scheduler.kv_cache.spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
    manager_spec,
)
from scheduler.output import TierPage
from scheduler.request import Request


@dataclass(frozen=True)
class HeldKeys:
    """Per group, the hashes of a prompt's blocks the receiver holds on its device pool."""

    fingerprint: str
    """The receiver's model and KV layout (`transfer_fingerprint`): the sender's must equal it."""
    groups: tuple[frozenset[BlockHash], ...]


@dataclass(frozen=True)
class CheckpointKey:
    """A state checkpoint a transfer carries past the block grid (the sender's hit ends there)."""

    num_tokens: int
    """Its position: the tokens before it."""
    key: BlockHash
    """Its blocks' key in every group holding one (the state, a partial attention block)."""
    grid_key: BlockHash | None = None
    """An answer end's: the unit-grid key the receiver indexes it under (None: a grid one)."""


@dataclass(frozen=True)
class TransferKeys:
    """The keys of the blocks one transfer carries, per group in block order."""

    fingerprint: str
    num_hit_tokens: int
    """The sender's prefix hit: what the receiver can hit once it holds every block."""
    groups: tuple[tuple[BlockHash, ...], ...]
    num_held_blocks: int = 0
    """Blocks of the hit the receiver already held (not sent)."""
    num_tier_blocks: int = 0
    """Blocks sent from the sender's offload tier (host memory or disk)."""
    checkpoint: CheckpointKey | None = None
    """The checkpoint the hit ends at (last in each of its groups' keys); None: a block end."""

    @property
    def num_blocks(self) -> int:
        return sum(len(keys) for keys in self.groups)


@dataclass(frozen=True)
class ExportPlan:
    """What the sender's workers copy out: per group, the pool blocks of `keys` in order, and
    the pages of `keys` its offload tier holds instead (at their places in that order)."""

    keys: TransferKeys
    block_ids: tuple[tuple[int, ...], ...]
    tier_pages: tuple[tuple[TierPage, ...], ...] = ()


@dataclass(frozen=True)
class ImportReservation:
    """Fresh receiver blocks for the keys not held yet; `selected` indexes `keys.groups[g]`."""

    keys: TransferKeys
    blocks: tuple[tuple[KVCacheBlock, ...], ...]
    selected: tuple[tuple[int, ...], ...]

    @property
    def block_ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(block.block_id for block in group) for group in self.blocks)


def transfer_fingerprint(config: KVCacheConfig, model_id: str, cache_dtypes: str = "") -> str:
    """Names the model and its KV layout (groups, block sizes, windows, state modes, dtypes)
    but not the per-rank sizes tensor parallelism divides (KV heads, state shapes, page
    padding): engines of one model at different tensor-parallel sizes get the same one.

    `cache_dtypes` names how pages encode their elements (e.g. "kv fp8_e4m3, state bfloat16"):
    hashed with the rest, and shown after the hash so that a refused transfer says why."""
    groups = tuple(replace(group, spec=_without_rank_sizes(group.spec)) for group in config.groups)
    layout = KVCacheConfig(num_blocks=0, groups=groups, tensors=())
    digest = layout_fingerprint(layout, f"{model_id}|{cache_dtypes}")
    return f"{digest} ({cache_dtypes})" if cache_dtypes else digest


def _without_rank_sizes(spec: KVCacheSpec) -> KVCacheSpec:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        members = tuple((name, _without_rank_sizes(m)) for name, m in spec.kv_cache_specs)
        return replace(spec, kv_cache_specs=members)
    if isinstance(spec, AttentionSpec):
        return replace(spec, num_kv_heads=0)
    if isinstance(spec, MambaSpec):
        return replace(spec, shapes=tuple(() for _ in spec.shapes), page_size_padded=None)
    return spec


def held_keys(
    manager: KVCacheManager, block_hashes: Sequence[BlockHash], fingerprint: str
) -> HeldKeys:
    """The receiver's side of the handshake: per group, which of the prompt's block hashes its
    device pool has registered (so the sender leaves them out)."""
    groups = []
    for manager_of_group in manager.coordinator.managers:
        hash_map = manager.pool.hash_maps[manager_of_group.group_id]
        count = len(block_hashes) // manager_of_group.hash_ratio
        hashes = (manager_of_group.hash_of(block_hashes, index) for index in range(count))
        groups.append(frozenset(h for h in hashes if h in hash_map))
    return HeldKeys(fingerprint, tuple(groups))


def find_export(
    manager: KVCacheManager,
    block_hashes: Sequence[BlockHash],
    max_length: int,
    held: HeldKeys,
    fingerprint: str,
    request: Request | None = None,
) -> ExportPlan:
    """The sender's longest prefix hit (at most `max_length` tokens) on its device pool and
    offload tier, less the blocks the receiver holds. With the prompt's `request` (of
    `max_length` + 1 tokens), the hit reaches the state checkpoints the sender's own lookup
    resumes from. ValueError when the two engines' layouts differ."""
    if held.fingerprint != fingerprint:
        raise ValueError(
            "kv transfer: the engines differ in model, KV layout or cache dtypes "
            f"(fingerprint {fingerprint} here, {held.fingerprint} at the receiver)"
        )
    if not manager.enable_caching:
        raise ValueError("kv transfer needs enable_prefix_caching on the sending engine")
    pool = manager.pool
    hit_blocks, num_hit, checkpoint = _longest_hit(manager, block_hashes, max_length, request)
    keys: list[tuple[BlockHash, ...]] = []
    block_ids: list[tuple[int, ...]] = []
    tier_pages: list[tuple[TierPage, ...]] = []
    num_held = 0
    for group_id, blocks in enumerate(hit_blocks):
        real = [b for b in blocks if b is not pool.null_block and b.block_hash is not None]
        sent = [b for b in real if b.block_hash not in held.groups[group_id]]
        num_held += len(real) - len(sent)
        keys.append(tuple(b.block_hash for b in sent if b.block_hash is not None))
        block_ids.append(tuple(b.block_id for b in sent if not isinstance(b, OffloadedBlock)))
        tier_pages.append(_tier_pages(sent))
    num_tier = sum(len(pages) for pages in tier_pages)
    transfer = TransferKeys(fingerprint, num_hit, tuple(keys), num_held, num_tier, checkpoint)
    return ExportPlan(transfer, tuple(block_ids), tuple(tier_pages))


def _longest_hit(
    manager: KVCacheManager,
    block_hashes: Sequence[BlockHash],
    max_length: int,
    request: Request | None,
) -> tuple[list[list[KVCacheBlock]], int, CheckpointKey | None]:
    """Per group the blocks of the sender's longest hit, its tokens, and the checkpoint it ends
    at: the lookup the sender's scheduler makes (`KVCacheManager.get_computed_blocks`), whose
    checkpoint hit appends the checkpoint's block to each group that has one."""
    found = manager.coordinator.find_longest_cache_hit(block_hashes, max_length)
    checkpoints = manager.checkpoints
    on_grid = [list(blocks) for blocks in found.blocks]
    if request is None or checkpoints is None:
        return on_grid, found.num_tokens, None
    assert request.num_tokens == max_length + 1, (request.num_tokens, max_length)
    fine = checkpoints.find(request, block_hashes, found.num_tokens)
    if fine is None:
        return on_grid, found.num_tokens, None
    null = manager.pool.null_block
    blocks = [
        _with_grid_blocks(list(grid), list(at_checkpoint), null)
        + ([source] if source is not None else [])
        for grid, at_checkpoint, source in zip(found.blocks, fine.blocks, fine.sources, strict=True)
    ]
    (key,) = {source.block_hash for source in fine.sources if source is not None}
    assert key is not None
    grid_key = None
    if checkpoints.is_answer_end(key):
        unit = checkpoints.unit
        grid_tokens = request.cache_token_ids[: fine.num_tokens // unit * unit]
        grid_key = checkpoint_keys(grid_tokens, unit, request.hash_salt, request.hash_root)[-1]
    return blocks, fine.num_tokens, CheckpointKey(fine.num_tokens, key, grid_key)


def _with_grid_blocks(
    grid: list[KVCacheBlock], at_checkpoint: list[KVCacheBlock], null: KVCacheBlock
) -> list[KVCacheBlock]:
    """A group's checkpoint-hit table with the block-grid hit's blocks in its null entries (a
    recurrent group's state at the grid hit's end): lookups on the block grid, such as a
    router's index of the receiver's KV events, then see the prefix there too."""
    merged = [
        grid[index] if block is null and index < len(grid) else block
        for index, block in enumerate(at_checkpoint)
    ]
    return merged + grid[len(merged) :]


def _tier_pages(sent: Sequence[KVCacheBlock]) -> tuple[TierPage, ...]:
    """The offload-tier entries among a group's sent blocks, at their places in it."""
    return tuple(
        TierPage(position, block.slot, block.file)
        for position, block in enumerate(sent)
        if isinstance(block, OffloadedBlock)
    )


def demote_export(manager: KVCacheManager, plan: ExportPlan) -> int:
    """The sender, once a conversation moved to the receiver: the blocks it sent go to the
    front of its eviction order (those a running request holds stay); how many moved. The
    last block of the prefix goes first: a recurrent state or a window tail is what a later
    hit here would need, and without it the earlier blocks are no hit."""
    ordered = [block_id for group in plan.block_ids for block_id in reversed(group)]
    return manager.pool.demote(ordered)


def reserve_import(manager: KVCacheManager, keys: TransferKeys) -> ImportReservation | None:
    """Fresh blocks for every key the receiver's device pool does not hold; None (nothing
    taken) when the pool has not that many free blocks."""
    pool = manager.pool
    selected = tuple(
        tuple(i for i, key in enumerate(group) if key not in pool.hash_maps[group_id])
        for group_id, group in enumerate(keys.groups)
    )
    if sum(len(indices) for indices in selected) > pool.num_free_blocks:
        return None
    blocks = tuple(
        tuple(pool.get_new_blocks(len(indices), group_id)) if indices else ()
        for group_id, indices in enumerate(selected)
    )
    return ImportReservation(keys, blocks, selected)


def commit_import(manager: KVCacheManager, reservation: ImportReservation) -> None:
    """The workers wrote the pages: register each block under its key; the blocks stay cached
    and evictable (no request holds them) until a prefix hit takes them."""
    pool = manager.pool
    for group_id, blocks in enumerate(reservation.blocks):
        keys = reservation.keys.groups[group_id]
        for block, index in zip(blocks, reservation.selected[group_id], strict=True):
            if keys[index] not in pool.hash_maps[group_id]:
                pool.register_block(block, keys[index])
        pool.free_blocks(blocks)
    _adopt_checkpoint(manager, reservation.keys.checkpoint)


def _adopt_checkpoint(manager: KVCacheManager, checkpoint: CheckpointKey | None) -> None:
    """An imported checkpoint is found as on the sender: a grid one by its key alone, an answer
    end through the index of its grid key; its blocks stay out of the offload tier (device
    lookups alone read them)."""
    if checkpoint is None:
        return
    pool = manager.pool
    for group_id, hash_map in enumerate(pool.hash_maps):
        if pool.offload is not None and checkpoint.key in hash_map:
            pool.offload.keep_on_device(group_id, checkpoint.key)
    if checkpoint.grid_key is not None and manager.checkpoints is not None:
        manager.checkpoints.remember_end(checkpoint.grid_key, checkpoint.num_tokens, checkpoint.key)


def abort_import(manager: KVCacheManager, reservation: ImportReservation) -> None:
    """The pages never arrived: the reserved blocks go back unregistered."""
    for blocks in reservation.blocks:
        manager.pool.free_blocks(blocks)


def needed_blocks(spec: KVCacheSpec, num_tokens: int) -> int:
    """Blocks of one group a hit of `num_tokens` tokens reads (the hybrid lower bound's rule).
    A hit off the group's block grid (at a state checkpoint) also reads the partial block there,
    and a transfer of it carries a recurrent group's state at the block grid's end before it
    too (what block-grid lookups read)."""
    spec = manager_spec(spec)
    partial = 1 if num_tokens % spec.block_size else 0
    if isinstance(spec, MambaSpec):
        return (1 if num_tokens >= spec.block_size else 0) + partial
    if isinstance(spec, SlidingWindowSpec):
        window = cdiv(spec.sliding_window - 1, spec.block_size)
        return min(window, num_tokens // spec.block_size) + partial
    return num_tokens // spec.block_size + partial


def hit_lower_bound_bytes(config: KVCacheConfig, num_tokens: int) -> int:
    """The hybrid lower bound of moving a hit of `num_tokens` tokens: per group, the blocks it
    reads times the group's block bytes (donor layers only, no padding)."""
    sizes = group_block_bytes(config)
    return sum(
        needed_blocks(group.spec, num_tokens) * size
        for group, size in zip(config.groups, sizes, strict=True)
    )


__all__ = [
    "CheckpointKey",
    "ExportPlan",
    "HeldKeys",
    "ImportReservation",
    "TransferKeys",
    "abort_import",
    "commit_import",
    "demote_export",
    "find_export",
    "held_keys",
    "hit_lower_bound_bytes",
    "needed_blocks",
    "reserve_import",
    "transfer_fingerprint",
]

"""KV cache transfer between two engine cores: the receiver says which of a prompt's blocks it
holds, the sender exports the rest of its longest prefix hit (the hybrid minimum, each
tensor-parallel rank its own shard), the receiver imports them into its pool and prefix cache,
so its next lookup of the prompt hits them. The two engines may run different tensor-parallel
sizes: the shards travel as sent, and the receiver's ranks reshard them.

    receiver.held ─► HeldKeys ─► sender.export ─► KVTransfer (keys + per-rank shards)
                                                     │ Ray's object store between actors; or
                                                     │ each rank's shard offered, its pages
                                                     │ sent rank to rank (`worker.kv_io.kv_direct`)
                                                     ▼
                                              receiver.import ─► KVImportResult

The sending engine's `kv_transfer_transport` picks the way: `object_store` (the default) or
`direct`, where only the offers travel between the engines and each receiving rank takes its
shard from the sending rank of its number (a receiver of another tensor-parallel size takes
every shard in its engine's process first, `receive`, and reshards as usual). The functions run
on an engine core between steps (the async engine calls them under its lock).
`transfer_prefix` chains them for two cores in one process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.core import EngineCore
from cluster.engine.kv_transfer_counters import KVTransferCounters
from scheduler.block_hash import BlockHash
from scheduler.kv_cache.transfer import (
    HeldKeys,
    TransferKeys,
    abort_import,
    commit_import,
    demote_export,
    find_export,
    held_keys,
    reserve_import,
)
from scheduler.request import Request, SamplingParams
from worker.deadlines import timeout_until
from worker.kv_io.kv_direct import SEND_TIMEOUT_S, ShardOffer, fetch_shard
from worker.kv_io.kv_transfer import KVShard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVTransfer:
    """One transfer on the wire: the keys, and each rank's pages of them (or the offer of
    them, with the direct transport)."""

    keys: TransferKeys
    shards: tuple[KVShard | ShardOffer, ...]

    @property
    def is_offered(self) -> bool:
        """Whether the pages wait in the sending ranks (direct transport)."""
        return any(isinstance(shard, ShardOffer) for shard in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    def group_bytes(self) -> tuple[int, ...]:
        """Bytes per KV cache group, over every rank."""
        return tuple(
            sum(shard.pages[group_id].nbytes for shard in self.shards)
            for group_id in range(len(self.keys.groups))
        )


@dataclass(frozen=True)
class KVImportResult:
    """What a receiver took from one transfer."""

    num_blocks: int
    """Blocks written into the pool (keys it held meanwhile are skipped)."""
    num_bytes: int
    num_hit_tokens: int
    """The sender's hit: the prefix the receiver can now hit (when nothing was evicted)."""


def prompt_probe(
    core: EngineCore, prompt_token_ids: Sequence[int], cache_salt: str | None = None
) -> Request:
    """A request of the prompt as this engine's scheduler would look it up (never run)."""
    return Request(
        req_id="kv-transfer",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(),
        hash_block_size=core.scheduler.hash_block_size,
        cache_salt=cache_salt,
        hash_root=core.weights.root,
    )


def prompt_block_hashes(
    core: EngineCore, prompt_token_ids: Sequence[int], cache_salt: str | None = None
) -> list[BlockHash]:
    """The prompt's block hashes as this engine's prefix cache keys them."""
    return prompt_probe(core, prompt_token_ids, cache_salt).block_hashes


def kv_held_keys(
    core: EngineCore, prompt_token_ids: Sequence[int], cache_salt: str | None = None
) -> HeldKeys:
    """Receiver, first: which of the prompt's blocks this engine holds (not to be sent)."""
    hashes = prompt_block_hashes(core, prompt_token_ids, cache_salt)
    return held_keys(core.scheduler.kv_cache_manager, hashes, core.kv_transfer_fingerprint)


def kv_export(
    core: EngineCore,
    prompt_token_ids: Sequence[int],
    held: HeldKeys,
    cache_salt: str | None = None,
    demote: bool = False,
    timeout_s: float = SEND_TIMEOUT_S,
) -> KVTransfer:
    """Sender: the blocks of this engine's longest hit on the prompt (never its last token, its
    offload tier and state checkpoints included: the hit its own scheduler would resume from,
    no recompute) that the receiver does not hold, each rank's shard in
    host memory (with the direct transport, offered by each rank for `timeout_s`); with
    `demote` (the conversation moved to the receiver) those blocks are then evicted here
    first."""
    started = time.perf_counter()
    probe = prompt_probe(core, prompt_token_ids, cache_salt)
    manager = core.scheduler.kv_cache_manager
    max_length = len(prompt_token_ids) - 1
    _run_tier_copies(core)  # every tier entry the plan may read is in place
    fingerprint = core.kv_transfer_fingerprint
    plan = find_export(manager, probe.block_hashes, max_length, held, fingerprint, probe)
    offer = core.kv_transfer_transport == "direct" and plan.keys.num_blocks > 0
    offer_timeout_s = timeout_s if offer else None
    shards = core.executor.collective_rpc(
        "export_kv_shard", plan.block_ids, plan.tier_pages, offer_timeout_s
    )
    transfer = KVTransfer(
        plan.keys, tuple(s for s in shards if isinstance(s, KVShard | ShardOffer))
    )
    if demote:
        demote_export(manager, plan)
    counters = core.kv_transfer_counters
    counters.num_exports += 1
    counters.num_offers += offer
    for group_id, size in enumerate(transfer.group_bytes()):
        counters.blocks_sent[group_id] += len(plan.keys.groups[group_id])
        counters.bytes_sent[group_id] += size
    counters.export_seconds += time.perf_counter() - started
    logger.debug(
        "kv export: %d blocks (%d from the tier, %d held by the receiver), %d bytes, hit %d",
        plan.keys.num_blocks,
        plan.keys.num_tier_blocks,
        plan.keys.num_held_blocks,
        transfer.nbytes,
        plan.keys.num_hit_tokens,
    )
    return transfer


def receive(transfer: KVTransfer, num_ranks: int, timeout_s: float = SEND_TIMEOUT_S) -> KVTransfer:
    """The transfer as a receiver of `num_ranks` ranks imports it: offered shards stay offers
    when the sender ran as many ranks (each rank takes its own), else they are taken here,
    within `timeout_s` (RuntimeError naming the sender when that fails)."""
    if not _taken_by_engine(transfer, num_ranks):
        return transfer
    deadline = time.monotonic() + timeout_s
    shards = tuple(
        fetch_shard(shard, timeout_until(deadline)) if isinstance(shard, ShardOffer) else shard
        for shard in transfer.shards
    )
    return KVTransfer(transfer.keys, shards)


async def import_within(
    engine: AsyncEngine, transfer: KVTransfer, timeout_s: float
) -> KVImportResult:
    """`kv_import` on an async engine within `timeout_s`: offered shards its engine takes
    itself come first, on a thread off the engine's lock; its ranks take theirs in what is
    left."""
    deadline = time.monotonic() + timeout_s
    ranks = engine.core.executor.configs.tensor_parallel_size
    if _taken_by_engine(transfer, ranks):
        transfer = await asyncio.to_thread(receive, transfer, ranks, timeout_s)
    result: KVImportResult = await engine.call_core(kv_import, transfer, timeout_until(deadline))
    return result


def _taken_by_engine(transfer: KVTransfer, num_ranks: int) -> bool:
    """Whether a receiver of `num_ranks` ranks takes the offered shards in its engine's
    process (a reshard needs every shard on every rank) rather than rank by rank."""
    return transfer.is_offered and len(transfer.shards) != num_ranks


def kv_import(
    core: EngineCore, transfer: KVTransfer, timeout_s: float = SEND_TIMEOUT_S
) -> KVImportResult:
    """Receiver: write the pages into fresh blocks and register them in the prefix cache (each
    rank resharding them when the sender ran another tensor-parallel size); a transfer there is
    no room for takes nothing (the request recomputes). Offered shards are taken within
    `timeout_s`: by each rank from its sending rank, or first here for a reshard (`import_within`
    takes those before, off the engine's lock)."""
    started = time.perf_counter()
    transfer = receive(transfer, core.executor.configs.tensor_parallel_size, timeout_s)
    counters = core.kv_transfer_counters
    if transfer.keys.fingerprint != core.kv_transfer_fingerprint:
        raise ValueError(
            "kv transfer: the sending engine runs another model, KV layout or cache dtypes "
            f"(fingerprint {transfer.keys.fingerprint} there, {core.kv_transfer_fingerprint} "
            "here): its pages are not imported"
        )
    manager = core.scheduler.kv_cache_manager
    reservation = reserve_import(manager, transfer.keys)
    if reservation is None:
        counters.num_failed_imports += 1
        logger.warning("kv import: no room for %d blocks; recomputing", transfer.keys.num_blocks)
        return KVImportResult(0, transfer.nbytes, 0)
    try:
        _run_tier_copies(core)  # evicted blocks reach the tier before they are overwritten
        core.executor.collective_rpc(
            "import_kv_shards",
            transfer.shards,
            reservation.selected,
            reservation.block_ids,
            timeout_s,
        )
    except BaseException:
        abort_import(manager, reservation)
        counters.num_failed_imports += 1
        raise
    commit_import(manager, reservation)
    counters.num_imports += 1
    for group_id, size in enumerate(transfer.group_bytes()):
        counters.blocks_received[group_id] += len(reservation.blocks[group_id])
        counters.bytes_received[group_id] += size
    counters.import_seconds += time.perf_counter() - started
    num_blocks = sum(len(blocks) for blocks in reservation.blocks)
    return KVImportResult(num_blocks, transfer.nbytes, transfer.keys.num_hit_tokens)


def transfer_counters(core: EngineCore) -> KVTransferCounters:
    """A copy of the engine's transfer counters with its ranks' direct sends read in (the
    offers' threads run in the ranks' processes)."""
    counts = [c for c in core.executor.collective_rpc("kv_offer_counts") if isinstance(c, tuple)]
    snapshot = core.kv_transfer_counters.snapshot()
    snapshot.num_sends_pending = sum(made - ended for made, ended, _ in counts)
    snapshot.num_failed_sends = sum(failed for _, _, failed in counts)
    return snapshot


def _run_tier_copies(core: EngineCore) -> None:
    """Run the offload tier's pending stores now (the reservation may have evicted blocks the
    tier keeps a copy of; the import is about to overwrite them)."""
    manager = core.scheduler.kv_cache_manager
    if manager.pool.offload is None:
        return
    ops = manager.take_offload_ops()
    if ops.stores or ops.spills or ops.drops or ops.disk_drops:
        assert not ops.loads, "tier loads are only issued by a step"
        core.executor.collective_rpc("run_offload_ops", ops)


def transfer_prefix(
    sender: EngineCore,
    receiver: EngineCore,
    prompt_token_ids: Sequence[int],
    cache_salt: str | None = None,
) -> KVImportResult:
    """Move the sender's cached prefix of the prompt into the receiver (both in this process)."""
    held = kv_held_keys(receiver, prompt_token_ids, cache_salt)
    transfer = kv_export(sender, prompt_token_ids, held, cache_salt)
    return kv_import(receiver, transfer)

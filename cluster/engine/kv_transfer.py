"""KV cache transfer between two engine cores: the receiver says which of a prompt's blocks it
holds, the sender exports the rest of its longest prefix hit (the hybrid minimum, each
tensor-parallel rank its own shard), the receiver imports them into its pool and prefix cache,
so its next lookup of the prompt hits them. The two engines may run different tensor-parallel
sizes: the shards travel as sent, and the receiver's ranks reshard them.

    receiver.held ─► HeldKeys ─► sender.export ─► KVTransfer (keys + per-rank shards)
                                                     │ Ray's object store between actors, or
                                                     │ a KVTransferOffer: the pages go over a
                                                     │ direct connection (`receive`)
                                                     ▼
                                              receiver.import ─► KVImportResult

The sending engine's `kv_transfer_transport` picks the way: `object_store` (the default) or
`direct` (docs/benchmarks.md, "Direct connection against the object store", has them at parity
on CPU, pages included). The functions run on an engine core between steps (the
async engine calls them under its lock); a receiver takes an offer's pages (`receive`) before
that, off the lock. `transfer_prefix` chains them for two cores in one process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.config.engine_args import KVTransferTransport
from cluster.engine import kv_transfer_direct as direct
from cluster.engine.core import EngineCore
from cluster.engine.kv_transfer_counters import KVTransferCounters
from cluster.engine.kv_transfer_direct import KVTransferOffer
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
from worker.kv_transfer import KVShard

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVTransfer:
    """One transfer on the wire: the keys, and each rank's pages of them."""

    keys: TransferKeys
    shards: tuple[KVShard, ...]

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


def prompt_block_hashes(
    core: EngineCore, prompt_token_ids: Sequence[int], cache_salt: str | None = None
) -> list[BlockHash]:
    """The prompt's block hashes as this engine's prefix cache keys them."""
    probe = Request(
        req_id="kv-transfer",
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(),
        hash_block_size=core.scheduler.hash_block_size,
        cache_salt=cache_salt,
    )
    return probe.block_hashes


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
    timeout_s: float = direct.SEND_TIMEOUT_S,
) -> KVTransfer | KVTransferOffer:
    """Sender: the blocks of this engine's longest hit on the prompt (never its last token, its
    offload tier included: no recompute) that the receiver does not hold, each rank's shard in
    host memory (or offered over a direct connection, as the engine's transport says, for
    `timeout_s`); with `demote` (the conversation moved to the receiver) those blocks are then
    evicted here first."""
    started = time.perf_counter()
    hashes = prompt_block_hashes(core, prompt_token_ids, cache_salt)
    manager = core.scheduler.kv_cache_manager
    max_length = len(prompt_token_ids) - 1
    _run_tier_copies(core)  # every tier entry the plan may read is in place
    plan = find_export(manager, hashes, max_length, held, core.kv_transfer_fingerprint)
    shards = core.executor.collective_rpc("export_kv_shard", plan.block_ids, plan.tier_pages)
    transfer = KVTransfer(plan.keys, tuple(s for s in shards if isinstance(s, KVShard)))
    if demote:
        demote_export(manager, plan)
    counters = core.kv_transfer_counters
    counters.num_exports += 1
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
    return outgoing(transfer, core.kv_transfer_transport, timeout_s, counters)


def outgoing(
    transfer: KVTransfer,
    transport: KVTransferTransport,
    timeout_s: float,
    counters: KVTransferCounters,
) -> KVTransfer | KVTransferOffer:
    """The transfer itself (its pages travel with it), or an offer of its pages over a direct
    connection from this process for `timeout_s` (its end counted in `counters`)."""
    if transport != "direct" or transfer.keys.num_blocks == 0:
        return transfer
    try:
        host = direct.node_address()
        offer = direct.offer(transfer.keys, transfer.shards, host, timeout_s, counters.end_offer)
    except (RuntimeError, OSError) as exc:  # no rendezvous store could be opened here
        logger.warning("kv transfer: no direct connection (%s); using the object store", exc)
        return transfer
    counters.num_offers += 1
    return offer


def receive(
    transfer: KVTransfer | KVTransferOffer, timeout_s: float = direct.SEND_TIMEOUT_S
) -> KVTransfer:
    """The transfer with its pages here: an offer's taken from its sender within `timeout_s`
    (RuntimeError when that fails); a transfer that carries them, as it is."""
    if isinstance(transfer, KVTransfer):
        return transfer
    shards = direct.fetch(transfer, direct.node_address(), timeout_s)
    return KVTransfer(transfer.keys, shards)


async def receive_off_loop(
    transfer: KVTransfer | KVTransferOffer, timeout_s: float = direct.SEND_TIMEOUT_S
) -> KVTransfer:
    """`receive` for a caller on an event loop: an offer's pages come on a thread."""
    if isinstance(transfer, KVTransfer):
        return transfer
    return await asyncio.to_thread(receive, transfer, timeout_s)


def kv_import(core: EngineCore, transfer: KVTransfer | KVTransferOffer) -> KVImportResult:
    """Receiver: write the pages into fresh blocks and register them in the prefix cache (each
    rank resharding them when the sender ran another tensor-parallel size); a transfer there is
    no room for takes nothing (the request recomputes). An offer is received first (callers
    on an event loop `receive` it before, off the engine's lock)."""
    started = time.perf_counter()
    transfer = receive(transfer)
    counters = core.kv_transfer_counters
    if transfer.keys.fingerprint != core.kv_transfer_fingerprint:
        raise ValueError("kv transfer: the sending engine runs another model or KV layout")
    manager = core.scheduler.kv_cache_manager
    reservation = reserve_import(manager, transfer.keys)
    if reservation is None:
        counters.num_failed_imports += 1
        logger.warning("kv import: no room for %d blocks; recomputing", transfer.keys.num_blocks)
        return KVImportResult(0, transfer.nbytes, 0)
    try:
        _run_tier_copies(core)  # evicted blocks reach the tier before they are overwritten
        core.executor.collective_rpc(
            "import_kv_shards", transfer.shards, reservation.selected, reservation.block_ids
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

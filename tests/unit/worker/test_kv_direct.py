"""Direct KV transfers in one process (the offering side's thread and the taking caller): a
rank's pages arrive bit for bit whatever their dtype and size; an engine of another
tensor-parallel size takes every offered shard itself before resharding; a sender that accepts
the connection and never answers, one that is gone, and an offer nobody takes all end within
their deadlines."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from cluster.engine.kv_transfer import KVTransfer, receive
from scheduler.kv_cache.transfer import TransferKeys
from tests.helpers.waiting import wait_until
from worker.kv_io.block_export import BlockPages
from worker.kv_io.kv_direct import ShardOffer, fetch_shard, offer_counts, offer_shard
from worker.kv_io.kv_transfer import KVShard

HOST = "127.0.0.1"
UNBOUNDED_S = 30.0
"""Long past every deadline here: a fetch still waiting then would wait for ever."""
FETCH_FAILED = r"kv transfer from 127\.0\.0\.1:\d+ failed: "


def _shard(rank: int, num_bytes: int) -> KVShard:
    """A rank's pages of two groups: fp32 K/V pages and a bf16 state page."""
    generator = torch.Generator().manual_seed(rank)
    rows = num_bytes // (2 * 64 * 4) + 1  # K and V, 64 fp32 per row
    kv = BlockPages(0, 3, (torch.randn(rows, 64, generator=generator),) * 2)
    state = BlockPages(1, 1, (torch.randn(1, 5, 7, generator=generator).bfloat16(),))
    return KVShard(rank, (kv, state))


def _same(a: KVShard, b: KVShard) -> bool:
    pairs = [
        (x, y)
        for pa, pb in zip(a.pages, b.pages, strict=True)
        for x, y in zip(pa.tensors, pb.tensors, strict=True)
    ]
    return a.rank == b.rank and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)


def _settled(made_before: int) -> tuple[int, int, int]:
    """This process's offers made since `made_before`, still waiting and dropped, once every
    offer has ended (taken, or dropped at its deadline)."""

    def counts() -> tuple[int, int, int] | None:
        made, ended, failed = offer_counts()
        return (made - made_before, made - ended, failed) if ended >= made else None

    settled: tuple[int, int, int] = wait_until(counts, "every offer is taken or dropped")
    return settled


def test_offered_pages_arrive_exactly_of_any_dtype_and_size() -> None:
    made, _, failed = offer_counts()
    for num_bytes in (64 * 1024, 16 << 20):
        shard = _shard(1, num_bytes)
        offer = offer_shard(shard, HOST, timeout_s=5.0)
        assert offer.nbytes == shard.nbytes
        assert _same(fetch_shard(offer, timeout_s=5.0), shard)
    assert _settled(made) == (2, 0, failed)


def test_a_receiver_of_another_size_takes_every_offered_shard_itself() -> None:
    shards = (_shard(0, 4096), _shard(1, 4096))
    offers = tuple(offer_shard(shard, HOST, timeout_s=5.0) for shard in shards)
    keys = TransferKeys("fingerprint", 12, ((0, 1, 2), (3,)))  # type: ignore[arg-type]
    offered = KVTransfer(keys, offers)
    assert offered.is_offered
    assert receive(offered, num_ranks=2) is offered  # same size: each rank takes its own
    taken = receive(offered, num_ranks=1)
    assert not taken.is_offered
    assert all(_same(a, b) for a, b in zip(taken.shards, shards, strict=True))  # type: ignore[arg-type]
    assert taken.group_bytes() == offered.group_bytes()


def test_an_offer_nobody_takes_is_dropped_at_its_deadline() -> None:
    made, _, failed = offer_counts()
    offer_shard(_shard(0, 1024), HOST, timeout_s=0.5)
    assert _settled(made) == (1, 0, failed + 1)


@pytest.fixture
def silent_sender() -> Iterator[tuple[str, int]]:
    """An address that accepts connections and never answers (a stopped process's)."""
    with socket.create_server((HOST, 0)) as listener:
        yield HOST, listener.getsockname()[1]


def _failed_fetch(offer: ShardOffer, timeout_s: float) -> str:
    """The error of a fetch that must fail, run on a thread that must end long before a fetch
    without a deadline would (the silent sender never answers)."""
    pool = ThreadPoolExecutor(1)
    try:
        with pytest.raises(RuntimeError, match=FETCH_FAILED) as error:
            pool.submit(fetch_shard, offer, timeout_s).result(timeout=UNBOUNDED_S)
    finally:
        pool.shutdown(wait=False)
    return str(error.value)


def test_a_silent_or_gone_sender_fails_the_fetch_at_its_deadline_or_at_once(
    silent_sender: tuple[str, int],
) -> None:
    """A sender that never answers fails the fetch at the fetch's deadline; one that is gone
    fails it on the refused connection (no wait for a deadline)."""
    live = offer_shard(_shard(0, 1024), HOST, timeout_s=5.0)
    fetch_shard(live, timeout_s=5.0)  # taken, so nothing waits for it
    with socket.create_server((HOST, 0)) as closed:
        gone_port = closed.getsockname()[1]
    silent = replace(live, address=silent_sender, transfer_id="0" * 32)
    assert _failed_fetch(silent, timeout_s=0.5).endswith("failed: no pages in time")
    gone = replace(live, address=(HOST, gone_port), transfer_id="0" * 32)
    assert "no pages in time" not in _failed_fetch(gone, timeout_s=UNBOUNDED_S)

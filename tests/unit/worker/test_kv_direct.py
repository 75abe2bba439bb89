"""Direct KV transfers in one process (the offering side's thread and the taking caller): a
rank's pages arrive bit for bit whatever their dtype and size; an engine of another
tensor-parallel size takes every offered shard itself before resharding; a sender that accepts
the connection and never answers, one that is gone, and an offer nobody takes all end within
their deadlines."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from cluster.engine.kv_transfer import KVTransfer, receive
from scheduler.kv_cache.transfer import TransferKeys
from worker.block_export import BlockPages
from worker.kv_direct import ShardOffer, fetch_shard, offer_counts, offer_shard
from worker.kv_transfer import KVShard

HOST = "127.0.0.1"


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


def _settled(made_before: int, timeout_s: float = 10.0) -> tuple[int, int, int]:
    """This process's offer counts once every offer made since `made_before` has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        made, ended, failed = offer_counts()
        if ended >= made or time.monotonic() > deadline:
            return made - made_before, made - ended, failed


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
    started = time.monotonic()
    assert _settled(made) == (1, 0, failed + 1)
    assert time.monotonic() - started < 5.0


@pytest.fixture
def silent_sender() -> Iterator[tuple[str, int]]:
    """An address that accepts connections and never answers (a stopped process's)."""
    with socket.create_server((HOST, 0)) as listener:
        yield HOST, listener.getsockname()[1]


def test_a_silent_or_gone_sender_fails_the_fetch_within_its_deadline(
    silent_sender: tuple[str, int],
) -> None:
    live = offer_shard(_shard(0, 1024), HOST, timeout_s=5.0)
    fetch_shard(live, timeout_s=5.0)  # taken, so nothing waits for it
    with socket.create_server((HOST, 0)) as closed:
        gone_port = closed.getsockname()[1]
    for address in (silent_sender, (HOST, gone_port)):
        offer: ShardOffer = replace(live, address=address, transfer_id="0" * 32)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"kv transfer from 127\.0\.0\.1:\d+ failed"):
            fetch_shard(offer, timeout_s=1.0)
        assert time.monotonic() - started < 2.0

"""Direct KV transfers in one process (the sender's thread and the receiving caller): the pages
arrive bit for bit whatever their dtype, small and large; the object store transport sends the
pages themselves; a sender that accepts the connection and never answers, one that is gone,
and an offer nobody takes all end within their deadlines."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from cluster.engine import kv_transfer_direct as direct
from cluster.engine.kv_transfer import KVTransfer, outgoing, receive
from cluster.engine.kv_transfer_counters import KVTransferCounters
from cluster.engine.kv_transfer_direct import KVTransferOffer
from scheduler.kv_cache.transfer import TransferKeys
from worker.block_export import BlockPages
from worker.kv_transfer import KVShard

HOST = "127.0.0.1"


def _transfer(num_bytes: int) -> KVTransfer:
    """Two ranks' shards of two groups (fp32 K/V pages and a bf16 state page)."""
    generator = torch.Generator().manual_seed(0)
    rows = num_bytes // (2 * 2 * 64 * 4) + 1  # 2 ranks, K and V, 64 fp32 per row
    shards = []
    for rank in range(2):
        kv = BlockPages(0, 3, (torch.randn(rows, 64, generator=generator),) * 2)
        state = BlockPages(1, 1, (torch.randn(1, 5, 7, generator=generator).bfloat16(),))
        shards.append(KVShard(rank, (kv, state)))
    keys = TransferKeys("fingerprint", 12, (tuple(range(3)), (3,)))  # type: ignore[arg-type]
    return KVTransfer(keys, tuple(shards))


def _same_pages(a: KVTransfer, b: KVTransfer) -> bool:
    pairs = [
        (x, y)
        for sa, sb in zip(a.shards, b.shards, strict=True)
        for pa, pb in zip(sa.pages, sb.pages, strict=True)
        for x, y in zip(pa.tensors, pb.tensors, strict=True)
    ]
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)


def _settled(counters: KVTransferCounters, timeout_s: float = 10.0) -> KVTransferCounters:
    deadline = time.monotonic() + timeout_s
    while counters.num_offers_ended < counters.num_offers and time.monotonic() < deadline:
        time.sleep(0.02)
    return counters


def test_direct_pages_arrive_exactly_of_any_dtype_and_size() -> None:
    counters = KVTransferCounters(2)
    small, large = _transfer(64 * 1024), _transfer(16 << 20)
    assert outgoing(large, "object_store", 5.0, counters) is large
    for transfer in (small, large):
        offer = outgoing(transfer, "direct", 5.0, counters)
        assert isinstance(offer, KVTransferOffer), transfer.nbytes
        assert offer.nbytes == transfer.nbytes
        arrived = receive(offer, timeout_s=5.0)
        assert arrived.keys == transfer.keys
        assert _same_pages(arrived, transfer)
    assert _settled(counters).num_offers == 2
    assert (counters.num_offers_ended, counters.num_failed_sends) == (2, 0)


def test_an_offer_nobody_takes_is_dropped_at_its_deadline() -> None:
    counters = KVTransferCounters(2)
    outgoing(_transfer(1024), "direct", 0.5, counters)
    started = time.monotonic()
    _settled(counters)
    assert (counters.num_offers_ended, counters.num_failed_sends) == (1, 1)
    assert time.monotonic() - started < 5.0


@pytest.fixture
def silent_sender() -> Iterator[tuple[str, int]]:
    """An address that accepts connections and never answers (a stopped process's)."""
    with socket.create_server((HOST, 0)) as listener:
        yield HOST, listener.getsockname()[1]


def test_a_silent_or_gone_sender_fails_the_fetch_within_its_deadline(
    silent_sender: tuple[str, int],
) -> None:
    live = outgoing(_transfer(1024), "direct", 5.0, KVTransferCounters(2))
    assert isinstance(live, KVTransferOffer)
    receive(live)  # taken, so nothing waits for it
    with socket.create_server((HOST, 0)) as closed:
        gone_port = closed.getsockname()[1]
    for address in (silent_sender, (HOST, gone_port)):
        offer = KVTransferOffer(live.keys, address, "t", live.shards, live.nbytes, 5.0)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"kv transfer from 127\.0\.0\.1:\d+ failed"):
            direct.fetch(offer, HOST, timeout_s=1.0)
        assert time.monotonic() - started < 2.0

"""A rank's shard of a KV transfer sent straight from the sending rank's process to the one that
takes it, over a torch.distributed pair group (gloo over TCP), instead of through Ray.

    sending rank: export ─► KVShard (host pages) ─► offer_shard(): a thread waits for the
                  receiver, sends every page tensor, waits for its acknowledgement, drops them
                        │ ShardOffer (address, tensor shapes: bytes, not pages) via the engines
                        ▼
    taking rank (or engine): fetch_shard(offer) ─► joins the pair group, receives ─► KVShard

Each process that offers runs one rendezvous store (a `TCPStore` on its node address, any free
port); every offer gets a fresh two-rank group under its own key prefix, so transfers never wait
for one another and a broken one breaks nothing else. Both sides time out: a receiver that never
comes leaves the sender's thread at the offer's deadline (the pages are dropped and counted), a
sender that died or hangs fails the fetch within the caller's deadline.

The pages go socket to socket, skipping the object store and the engines' rank channels; the
price is the group's set-up (a few ms) and that the two nodes must reach each other on any TCP
port.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from worker.block_export import BlockPages
from worker.kv_transfer import KVShard

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0
"""How long a sender keeps an offer's pages for a receiver that has not taken them."""
_SENDER_RANK, _RECEIVER_RANK = 0, 1


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one page tensor of an offer, in send order."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        itemsize: int = getattr(torch, self.dtype).itemsize
        return count * itemsize

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype))


@dataclass(frozen=True)
class OfferedPages:
    """One KV cache group's pages in an offered shard: its blocks and its tensors' layout."""

    group_id: int
    num_blocks: int
    tensors: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.tensors)


@dataclass(frozen=True)
class ShardOffer:
    """A rank's shard whose pages wait in the sending process: where to take them, and their
    layout per KV cache group (in `KVShard` order)."""

    rank: int
    address: tuple[str, int]
    """The sender's rendezvous store (node address, port)."""
    transfer_id: str
    pages: tuple[OfferedPages, ...]
    timeout_s: float
    """The sender drops the pages this long after the offer."""

    @property
    def nbytes(self) -> int:
        return sum(group.nbytes for group in self.pages)

    def assemble(self, tensors: list[torch.Tensor]) -> KVShard:
        """The shard whose page tensors arrived as `tensors` (in send order)."""
        received = iter(tensors)
        pages = tuple(
            BlockPages(g.group_id, g.num_blocks, tuple(next(received) for _ in g.tensors))
            for g in self.pages
        )
        return KVShard(self.rank, pages)


def offer_shard(shard: KVShard, host: str, timeout_s: float = SEND_TIMEOUT_S) -> ShardOffer:
    """Hold the shard's pages in this process for one receiver, sent from `host` (this
    process's node address) once it comes, dropped after `timeout_s`; RuntimeError or OSError
    when no rendezvous store can be opened here."""
    return _outbox(host).offer(shard, timeout_s)


def fetch_shard(offer: ShardOffer, host: str, timeout_s: float) -> KVShard:
    """Receive an offered shard from its sender (`host`: this process's node address); a
    RuntimeError naming the sender when it is gone, hangs or the deadline passes.

    The receiving runs on its own thread, awaited here until the deadline: a sender whose
    process is stopped accepts the connection to its store and never answers, and torch's
    store client then waits past its own timeout (that thread is left to end when the sender
    does)."""
    sender = f"{offer.address[0]}:{offer.address[1]}"
    outcome: queue.Queue[list[torch.Tensor] | BaseException] = queue.Queue(maxsize=1)

    def run() -> None:
        handles: list[object] = []  # the store and group, closed off this thread's path
        try:
            outcome.put(_receive(offer, host, timeout_s, handles))
        except BaseException as exc:  # handed to the waiting caller
            outcome.put(exc)
        finally:
            _close_later(handles)

    threading.Thread(target=run, name=f"kv-fetch-{offer.transfer_id[:8]}", daemon=True).start()
    try:
        received = outcome.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(
            f"kv transfer from {sender} failed: no pages within {timeout_s:g} s"
        ) from None
    if isinstance(received, BaseException):
        text = str(received).strip()
        first = text.splitlines()[0] if text else type(received).__name__
        raise RuntimeError(f"kv transfer from {sender} failed: {first}") from None
    return offer.assemble(received)


def offer_counts() -> tuple[int, int, int]:
    """(offers made, offers ended: taken or dropped, offers dropped) by this process."""
    with _outboxes_lock:
        boxes = list(_outboxes.values())
    return (
        sum(b.num_offers for b in boxes),
        sum(b.num_ended for b in boxes),
        sum(b.num_failed for b in boxes),
    )


def _receive(
    offer: ShardOffer, host: str, timeout_s: float, handles: list[object]
) -> list[torch.Tensor]:
    store = TCPStore(*offer.address, None, False, timeout=_delta(timeout_s))
    handles.append(store)
    group = _pair_group(PrefixStore(offer.transfer_id, store), _RECEIVER_RANK, host, timeout_s)
    handles.append(group)
    tensors = [spec.empty() for group_pages in offer.pages for spec in group_pages.tensors]
    for tag, tensor in enumerate(tensors):
        group.recv([_as_bytes(tensor)], _SENDER_RANK, tag).wait()
    group.send([torch.ones(1, dtype=torch.uint8)], _SENDER_RANK, len(tensors)).wait()
    return tensors


class _Outbox:
    """This process's rendezvous store and the offers waiting in it."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.store = TCPStore(host, 0, None, True, timeout=_delta(SEND_TIMEOUT_S))
        self.port = self.store.port
        self._lock = threading.Lock()
        self.num_offers = 0
        self.num_ended = 0
        """Offers taken, or dropped (no receiver in time, or it broke off)."""
        self.num_failed = 0
        """Offers dropped."""

    def offer(self, shard: KVShard, timeout_s: float) -> ShardOffer:
        layout = tuple(
            OfferedPages(pages.group_id, pages.num_blocks, tuple(map(_spec, pages.tensors)))
            for pages in shard.pages
        )
        address = (self.host, self.port)
        offer = ShardOffer(shard.rank, address, uuid.uuid4().hex, layout, timeout_s)
        tensors = [tensor for pages in shard.pages for tensor in pages.tensors]
        with self._lock:
            self.num_offers += 1
        name = f"kv-send-{offer.transfer_id[:8]}"
        thread = threading.Thread(target=self._send, args=(offer, tensors), name=name, daemon=True)
        thread.start()
        return offer

    def _send(self, offer: ShardOffer, tensors: list[torch.Tensor]) -> None:
        """The offer's thread: send the pages once the receiver joins, then drop them."""
        failed = True
        try:
            store = PrefixStore(offer.transfer_id, self.store)
            group = _pair_group(store, _SENDER_RANK, self.host, offer.timeout_s)
            for tag, tensor in enumerate(tensors):
                group.send([_as_bytes(tensor)], _RECEIVER_RANK, tag).wait()
            group.recv([torch.empty(1, dtype=torch.uint8)], _RECEIVER_RANK, len(tensors)).wait()
            failed = False
        except RuntimeError as exc:
            logger.warning("kv transfer %s: not taken (%s)", offer.transfer_id[:8], exc)
        finally:
            with self._lock:
                self.num_ended += 1
                self.num_failed += failed


_outboxes: dict[str, _Outbox] = {}
_outboxes_lock = threading.Lock()


def _outbox(host: str) -> _Outbox:
    with _outboxes_lock:
        if host not in _outboxes:
            _outboxes[host] = _Outbox(host)
            logger.info("kv transfer: direct sends from %s:%d", host, _outboxes[host].port)
        return _outboxes[host]


def _spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def _pair_group(store: PrefixStore, rank: int, host: str, timeout_s: float) -> Any:
    """A two-rank gloo group over `store`, this side bound to `host` (its `send` and `recv`
    are not in torch's type stubs)."""
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = _delta(timeout_s)
    return ProcessGroupGloo(store, rank, 2, options)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat byte tensor (gloo sends any dtype the same way)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _close_later(handles: list[object]) -> None:
    """Drop the last references to a group and its store on another thread: tearing a gloo
    group down takes about 20 ms."""
    threading.Thread(target=handles.clear, name="kv-group-close", daemon=True).start()


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))

"""KV pages sent straight from the sending engine's process to the receiving one's, over a
torch.distributed pair group (gloo over TCP), instead of through Ray's object store.

    sender: kv_export ─► KVTransfer (host pages) ─► offer(): a thread waits for the receiver,
            sends every page tensor, waits for its acknowledgement, drops the pages
                  │ KVTransferOffer (keys, address, tensor shapes: bytes, not pages) via Ray
                  ▼
    receiver: fetch(offer) ─► joins the pair group, receives into fresh tensors ─► KVTransfer

Each engine process runs one rendezvous store (a `TCPStore` on its node address, any free port);
every transfer gets a fresh two-rank group under its own key prefix, so transfers never wait
for one another and a broken one breaks nothing else. Both sides time out: a receiver that never
comes leaves the sender's thread at the offer's deadline (the pages are dropped, counted as a
failed send), a sender that died or hangs fails the fetch within the caller's deadline.

The pages go socket to socket instead of in and out of the object store's shared memory; the
price is the group's set-up (a few ms) and that the two nodes must reach each other on any TCP
port.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from scheduler.kv_cache.transfer import TransferKeys
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

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype))


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group's pages in a rank's shard: its blocks and its tensors."""

    group_id: int
    num_blocks: int
    tensors: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class KVTransferOffer:
    """A transfer whose pages wait in the sender's process: where to take them, and their
    layout (each rank's shard, per KV cache group)."""

    keys: TransferKeys
    address: tuple[str, int]
    """The sender's rendezvous store (node address, port)."""
    transfer_id: str
    shards: tuple[tuple[int, tuple[GroupLayout, ...]], ...]
    """(rank, its groups' layouts) per shard, in send order."""
    nbytes: int
    timeout_s: float
    """The sender drops the pages this long after the offer."""

    def tensor_specs(self) -> list[TensorSpec]:
        return [spec for _, groups in self.shards for g in groups for spec in g.tensors]

    def assemble(self, tensors: Sequence[torch.Tensor]) -> tuple[KVShard, ...]:
        """The shards whose page tensors arrived as `tensors` (in send order)."""
        received = iter(tensors)
        shards = []
        for rank, groups in self.shards:
            pages = tuple(
                BlockPages(g.group_id, g.num_blocks, tuple(next(received) for _ in g.tensors))
                for g in groups
            )
            shards.append(KVShard(rank, pages))
        return tuple(shards)


def offer(
    keys: TransferKeys,
    shards: Sequence[KVShard],
    host: str,
    timeout_s: float = SEND_TIMEOUT_S,
    on_end: Callable[[bool], None] | None = None,
) -> KVTransferOffer:
    """Hold the shards' pages in this process for one receiver, sent from `host` (this
    process's node address) once it comes, dropped after `timeout_s` (`on_end(taken)` then);
    RuntimeError or OSError when no rendezvous store can be opened here."""
    return _outbox(host).offer(keys, tuple(shards), timeout_s, on_end)


def fetch(offer: KVTransferOffer, host: str, timeout_s: float) -> tuple[KVShard, ...]:
    """Receive an offer's pages from its sender (`host`: this process's node address); a
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


def _receive(
    offer: KVTransferOffer, host: str, timeout_s: float, handles: list[object]
) -> list[torch.Tensor]:
    store = TCPStore(*offer.address, None, False, timeout=_delta(timeout_s))
    handles.append(store)
    group = _pair_group(PrefixStore(offer.transfer_id, store), _RECEIVER_RANK, host, timeout_s)
    handles.append(group)
    tensors = [spec.empty() for spec in offer.tensor_specs()]
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
        self.num_pending = 0
        """Offers whose pages are still held (taken, failed or past their deadline: gone)."""
        self.num_failed = 0
        """Offers nobody took in time, or whose receiver broke off."""

    def offer(
        self,
        keys: TransferKeys,
        shards: tuple[KVShard, ...],
        timeout_s: float,
        on_end: Callable[[bool], None] | None,
    ) -> KVTransferOffer:
        layout = tuple((shard.rank, _layout(shard)) for shard in shards)
        nbytes = sum(shard.nbytes for shard in shards)
        address = (self.host, self.port)
        offer = KVTransferOffer(keys, address, uuid.uuid4().hex, layout, nbytes, timeout_s)
        tensors = [t for shard in shards for p in shard.pages for t in p.tensors]
        with self._lock:
            self.num_pending += 1
        name = f"kv-send-{offer.transfer_id[:8]}"
        args = (offer, tensors, on_end)
        thread = threading.Thread(target=self._send, args=args, name=name, daemon=True)
        thread.start()
        return offer

    def _send(
        self,
        offer: KVTransferOffer,
        tensors: list[torch.Tensor],
        on_end: Callable[[bool], None] | None,
    ) -> None:
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
                self.num_pending -= 1
                self.num_failed += failed
            if on_end is not None:
                on_end(not failed)


_outboxes: dict[str, _Outbox] = {}
_outboxes_lock = threading.Lock()


def node_address() -> str:
    """This process's node address (Ray's, when it runs under Ray; else the loopback)."""
    if ray.is_initialized():
        address: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return address
    return "127.0.0.1"


def _outbox(host: str) -> _Outbox:
    with _outboxes_lock:
        if host not in _outboxes:
            _outboxes[host] = _Outbox(host)
            logger.info("kv transfer: direct sends from %s:%d", host, _outboxes[host].port)
        return _outboxes[host]


def pending_sends() -> tuple[int, int]:
    """(offers whose pages this process still holds, offers that failed), over its stores."""
    with _outboxes_lock:
        boxes = list(_outboxes.values())
    return sum(b.num_pending for b in boxes), sum(b.num_failed for b in boxes)


def _layout(shard: KVShard) -> tuple[GroupLayout, ...]:
    return tuple(
        GroupLayout(pages.group_id, pages.num_blocks, tuple(map(_spec, pages.tensors)))
        for pages in shard.pages
    )


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

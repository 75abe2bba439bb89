"""A rank's shard of a KV transfer sent straight from the sending rank's process to the one that
takes it, over a TCP connection of its own, instead of through Ray.

    sending rank: export ─► KVShard (host pages) ─► offer_shard(): the pages wait under a
                  transfer ID in this process's outbox (a listening socket on its node address)
                        │ ShardOffer (address, ID, tensor shapes: bytes, not pages) via the engines
                        ▼
    taking rank (or engine): fetch_shard(offer) ─► connects, names the ID, receives every page
                  tensor straight into fresh tensors, acknowledges ─► KVShard

One outbox per process and node address, one connection per fetch: transfers never wait for
one another, a fetch can only ever read the pages of the ID it names, and a broken connection
breaks nothing else. Both sides keep deadlines: pages nobody takes are dropped at the offer's
(and counted), and a fetch whose sender is gone, stopped or slow fails at the caller's.

The pages go socket to socket, skipping the object store and the engines' rank channels; the
price is a connection per shard and that the two nodes must reach each other on any TCP port.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from worker.deadlines import timeout_until
from worker.kv_io.block_export import BlockPages
from worker.kv_io.kv_transfer import KVShard

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 30.0
"""How long a sender keeps an offer's pages for a receiver that has not taken them."""
_ID_BYTES = 32
"""A transfer ID on the wire: 32 hex digits."""
_ACK = b"\x01"
_SWEEP_S = 0.2
"""How often an outbox looks for offers past their deadline."""


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
    """Hold the shard's pages in this process for one receiver, served from `host` (this
    process's node address) once it comes, dropped after `timeout_s`; OSError when no socket
    can listen there."""
    return _outbox(host).offer(shard, timeout_s)


def fetch_shard(offer: ShardOffer, timeout_s: float) -> KVShard:
    """Receive an offered shard from its sender within `timeout_s`; a RuntimeError naming the
    sender when it is gone, stopped, slow, or no longer holds the pages."""
    deadline = time.monotonic() + timeout_s
    tensors = [spec.empty() for group in offer.pages for spec in group.tensors]
    try:
        with socket.create_connection(offer.address, timeout=timeout_until(deadline)) as conn:
            conn.sendall(offer.transfer_id.encode())
            for tensor in tensors:
                _receive_into(conn, tensor, deadline)
            conn.sendall(_ACK)
    except (OSError, EOFError) as exc:
        sender = f"{offer.address[0]}:{offer.address[1]}"
        reason = "no pages in time" if isinstance(exc, TimeoutError) else str(exc) or "closed"
        raise RuntimeError(f"kv transfer from {sender} failed: {reason}") from None
    return offer.assemble(tensors)


def offer_counts() -> tuple[int, int, int]:
    """(offers made, offers ended: taken or dropped, offers dropped) by this process."""
    with _outboxes_lock:
        boxes = list(_outboxes.values())
    return (
        sum(b.num_offers for b in boxes),
        sum(b.num_ended for b in boxes),
        sum(b.num_failed for b in boxes),
    )


class _Outbox:
    """This process's listening socket on one node address, and the pages waiting in it."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.listener = socket.create_server((host, 0))
        self.port: int = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[list[torch.Tensor], float]] = {}
        """Transfer ID -> (its page tensors in send order, the offer's deadline)."""
        self.num_offers = 0
        self.num_ended = 0
        """Offers taken, or dropped (no receiver in time, or it broke off)."""
        self.num_failed = 0
        """Offers dropped."""
        name = f"kv-outbox-{self.port}"
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def offer(self, shard: KVShard, timeout_s: float) -> ShardOffer:
        layout = tuple(
            OfferedPages(pages.group_id, pages.num_blocks, tuple(map(_spec, pages.tensors)))
            for pages in shard.pages
        )
        transfer_id = uuid.uuid4().hex
        tensors = [tensor for pages in shard.pages for tensor in pages.tensors]
        with self._lock:
            self._waiting[transfer_id] = (tensors, time.monotonic() + timeout_s)
            self.num_offers += 1
        return ShardOffer(shard.rank, (self.host, self.port), transfer_id, layout, timeout_s)

    def _accept(self) -> None:
        """Serve each connection on its own thread; drop the offers past their deadline."""
        self.listener.settimeout(_SWEEP_S)
        while True:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                self._drop_expired()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One receiver's connection: the pages of the ID it names, then its acknowledgement."""
        with conn:
            try:
                conn.settimeout(SEND_TIMEOUT_S)
                transfer_id = _receive_exactly(conn, _ID_BYTES).decode(errors="replace")
            except (OSError, EOFError):
                return
            with self._lock:
                waiting = self._waiting.pop(transfer_id, None)
            if waiting is None:
                return  # unknown, taken or dropped: the receiver sees the connection close
            tensors, deadline = waiting
            taken = False
            try:
                conn.settimeout(timeout_until(deadline))
                for tensor in tensors:
                    conn.sendall(_buffer(tensor))
                taken = _receive_exactly(conn, len(_ACK)) == _ACK
            except (OSError, EOFError) as exc:
                logger.warning("kv transfer %s: not taken (%s)", transfer_id[:8], exc)
            self._end(taken)

    def _drop_expired(self) -> None:
        """Offers past their deadline lose their pages, unless a receiver took them."""
        now = time.monotonic()
        with self._lock:
            expired = [tid for tid, (_, deadline) in self._waiting.items() if deadline <= now]
            for transfer_id in expired:
                del self._waiting[transfer_id]
        for transfer_id in expired:
            logger.warning("kv transfer %s: not taken in time", transfer_id[:8])
            self._end(taken=False)

    def _end(self, taken: bool) -> None:
        with self._lock:
            self.num_ended += 1
            self.num_failed += not taken


_outboxes: dict[str, _Outbox] = {}
_outboxes_lock = threading.Lock()


def _outbox(host: str) -> _Outbox:
    with _outboxes_lock:
        if host not in _outboxes:
            _outboxes[host] = _Outbox(host)
            logger.info("kv transfer: direct sends from %s:%d", host, _outboxes[host].port)
        return _outboxes[host]


def _receive_into(conn: socket.socket, target: torch.Tensor, deadline: float) -> None:
    """Fill the contiguous tensor `target` from `conn` by `deadline` (TimeoutError past it)."""
    view = _buffer(target)
    filled = 0
    while filled < len(view):
        conn.settimeout(timeout_until(deadline))
        count = conn.recv_into(view[filled:])
        if count == 0:
            raise EOFError("the sender closed the connection (it no longer holds the pages)")
        filled += count


def _receive_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("connection closed")
        data += chunk
    return data


def _spec(tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


def _buffer(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, shared (a contiguous tensor) or copied, as a writable buffer."""
    array: Any = _as_bytes(tensor).numpy()
    return memoryview(array)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a flat byte tensor (any dtype travels the same way)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)

"""Calls to tensor-parallel rank actors over direct connections (the Ray executor's dispatch).

Each rank actor runs one long-lived `serve_rank` loop on a connection the executor opened to it.
A call is pickled once and the same bytes go to every rank: no object-store round trip, no Ray
task per call (measured against plain actor calls and a compiled graph: docs/benchmarks.md).

    executor ──bytes(method, args)──► rank r: serve_rank: target(method, args) ──result──► executor

A dead rank shows as a closed connection (or, for a lost node, through `check_alive`, which the
executor answers by watching the ranks' long-running loop tasks); a stuck one as a reply still
missing when the timeout runs out.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
_POLL_S = 1.0
"""How often a wait for replies also asks `check_alive` (a lost node closes no connection)."""


@dataclass(frozen=True)
class RankFailure:
    """What a rank reports when a call raised."""

    message: str
    traceback: str
    is_value_error: bool
    """The call rejected its input or configuration (raised again as ValueError)."""

    @classmethod
    def from_exception(cls, exc: Exception) -> RankFailure:
        return cls(str(exc), traceback.format_exc(), isinstance(exc, ValueError))

    def to_exception(self, rank: int) -> Exception:
        """ValueError with the message for bad input, else RuntimeError with the traceback."""
        if self.is_value_error:
            logger.debug("tensor-parallel rank %d raised:\n%s", rank, self.traceback)
            return ValueError(f"tensor-parallel rank {rank}: {self.message}")
        return RuntimeError(f"tensor-parallel rank {rank} failed:\n{self.traceback}")


class RankDeadError(RuntimeError):
    """A rank's process or node is gone."""


class RankTimeoutError(RuntimeError):
    """A rank did not answer within the step timeout (hung)."""


def serve_rank(conn: Connection, target: Callable[[str, tuple[object, ...]], object]) -> None:
    """A rank's loop: answer each call with `target(method, args)` until shutdown or EOF."""
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if method == SHUTDOWN:
            return
        try:
            result = target(method, args)
        except Exception as exc:
            result = RankFailure.from_exception(exc)
        conn.send_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))


class RankChannels:
    """The executor's ends of the connections to every rank, in rank order."""

    def __init__(self, conns: Sequence[Connection], check_alive: Callable[[], None]) -> None:
        self._conns = list(conns)
        self._check_alive = check_alive
        self.call_started: float | None = None
        """`time.monotonic()` when the call now waiting for replies was sent (None: idle)."""
        self.is_broken = False
        """A call failed midway: replies may be owed, so no further call may be sent."""

    def call(
        self, method: str, args: tuple[object, ...], timeout: float | None = None
    ) -> list[object]:
        """Run `method(*args)` on every rank; results in rank order (a rank's error raised)."""
        if self.is_broken:
            raise RankDeadError("the ranks' connections failed earlier; restart the workers")
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.is_broken = True  # until every reply is read
        self.call_started = time.monotonic()
        try:
            for rank, conn in enumerate(self._conns):
                self._send(rank, conn, payload)
            results = self._read_replies(method, timeout)
        finally:
            self.call_started = None
        self.is_broken = False
        for rank, value in enumerate(results):
            if isinstance(value, RankFailure):
                raise value.to_exception(rank)
        return results

    def close(self) -> None:
        """Ask every rank's loop to end, then close the connections."""
        payload = pickle.dumps((SHUTDOWN, ()))
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(payload)
            conn.close()
        self._conns = []

    def _send(self, rank: int, conn: Connection, payload: bytes) -> None:
        try:
            conn.send_bytes(payload)
        except OSError:
            self._check_alive()
            raise RankDeadError(f"tensor-parallel rank {rank} closed its connection") from None

    def _read_replies(self, method: str, timeout: float | None) -> list[object]:
        results: list[object] = [None] * len(self._conns)
        unread = dict(enumerate(self._conns))
        deadline = None if timeout is None else time.monotonic() + timeout
        while unread:
            wait_s = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait_s <= 0:
                raise RankTimeoutError(
                    f"tensor-parallel rank(s) {sorted(unread)} did not finish {method!r} "
                    f"within {timeout:g} s (worker_step_timeout_s): the worker is hung"
                )
            ready = wait(list(unread.values()), timeout=wait_s)
            if not ready:
                self._check_alive()
            for rank, conn in list(unread.items()):
                if conn in ready:
                    results[rank] = self._recv(rank, conn)
                    del unread[rank]
        return results

    def _recv(self, rank: int, conn: Connection) -> object:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._check_alive()  # raises with Ray's reason when Ray already knows
            message = f"tensor-parallel rank {rank} died (its connection closed)"
            raise RankDeadError(message) from None

"""The one rank transport: calls to tensor-parallel ranks over direct connections, with deadlines.

Each rank (a Ray actor, or a spawned process) runs one long-lived `serve_rank` loop on a
connection to the executor. A call is pickled once and the same bytes go to every rank: no
object-store round trip, no Ray task per call (measured against plain actor calls and a compiled
graph: docs/benchmarks.md).

    executor ──bytes(method, args)──► rank r: serve_rank: target(method, args) ──result──► executor

Every call waits until a `Deadline`. A dead rank shows as a closed connection (or, for a lost
node, through `check_alive`, which the executor answers from the rank's process or actor); a
stuck one as a reply still missing when the deadline passes. This module imports no torch and
no Ray: both executors and the benchmarks use it as it is.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
import traceback
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from worker.deadlines import seconds_left

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
_POLL_S = 1.0
"""How often a wait for replies also asks `check_alive` (a lost node closes no connection)."""
_REASON_WAIT_S = 0.5
"""How long a closed connection waits for the process (or Ray) to tell why the rank died."""


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
    """A rank did not answer before the deadline (hung, or too slow to start)."""


@dataclass(frozen=True)
class Deadline:
    """When the ranks must have answered, and the setting that gave them that long."""

    at: float
    """`time.monotonic()` value."""
    seconds: float
    setting: str
    """The engine argument the time comes from (named in the error)."""

    @classmethod
    def after(cls, seconds: float, setting: str) -> Deadline:
        return cls(time.monotonic() + seconds, seconds, setting)

    def remaining(self) -> float:
        """Seconds left; 0 once the deadline passed."""
        return seconds_left(self.at)

    def error(self, what: str) -> RankTimeoutError:
        """The error for `what` not done by the deadline."""
        return RankTimeoutError(
            f"{what} did not finish within {self.seconds:g} s ({self.setting}): "
            "the worker is hung or too slow"
        )


class RankTarget:
    """What a rank's loop runs: `worker.method(*args)`, plus the test hook `delay_steps`."""

    def __init__(self, worker: object, rank: int) -> None:
        self.worker = worker
        self.rank = rank
        self.step_delay_s = 0.0

    def __call__(self, method: str, args: tuple[object, ...]) -> object:
        if method == "delay_steps":
            self.delay_steps(*args)  # type: ignore[arg-type]
            return None
        if method == "execute" and self.step_delay_s > 0:
            logger.warning("rank %d: delaying this step by %.1f s", self.rank, self.step_delay_s)
            time.sleep(self.step_delay_s)
        return getattr(self.worker, method)(*args)

    def delay_steps(self, seconds: float, ranks: Collection[int] | None = None) -> None:
        """Test hook: sleep `seconds` before each later step (a hung worker); only on `ranks`
        when given (the others then wait for it in the step's first collective)."""
        if ranks is None or self.rank in ranks:
            self.step_delay_s = seconds


def serve_rank(conn: Connection, target: Callable[[str, tuple[object, ...]], object]) -> None:
    """A rank's loop: answer each call with `target(method, args)` until shutdown, or until the
    executor's end of the connection closes (it gave up on this rank: it is being replaced)."""
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if method == SHUTDOWN:
            return
        try:
            result = target(method, args)
        except Exception as exc:
            result = RankFailure.from_exception(exc)
        try:
            conn.send_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            return


class RankChannels:
    """The executor's ends of the connections to every rank, in rank order."""

    def __init__(self, conns: Sequence[Connection], check_alive: Callable[[], None]) -> None:
        self._conns = list(conns)
        self._check_alive = check_alive
        self.deadline: Deadline | None = None
        """The deadline of the call now waiting for replies (None: idle)."""
        self.is_broken = False
        """A call failed midway: replies may be owed, so no further call may be sent."""
        self._unread: dict[int, Connection] = {}
        """Ranks whose reply to the last call sent has not been read yet."""
        self._submitted: deque[tuple[str, Deadline]] = deque()
        """Calls sent by `submit` whose replies `collect` has not read yet (oldest first)."""
        self._interrupted = False
        """A `collect` was interrupted (Ctrl-C): every reply still owed is dropped first."""

    def call(self, method: str, args: tuple[object, ...], deadline: Deadline) -> list[object]:
        """Run `method(*args)` on every rank; results in rank order (a rank's error raised).

        A call interrupted by Ctrl-C leaves its replies owed: the next call reads and drops
        them first, so a reply is never taken for the answer to a later call.
        """
        if self.is_broken:
            raise RankDeadError("the ranks' connections failed earlier; restart the workers")
        self._drop_owed_if_interrupted(deadline)
        if self._submitted:
            raise RuntimeError("submitted calls must be collected before another call")
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.is_broken = True  # until every reply is read
        self.deadline = deadline
        try:
            if self._unread:
                logger.warning("dropping the replies of an interrupted call")
                self._read_replies("an interrupted call", deadline)
            for rank, conn in enumerate(self._conns):
                self._send(rank, conn, payload)
                self._unread[rank] = conn
            results = self._read_replies(method, deadline)
        except KeyboardInterrupt:
            self.is_broken = False  # the ranks are fine; their replies are still owed
            raise
        finally:
            self.deadline = None
        self.is_broken = False
        for rank, value in enumerate(results):
            if isinstance(value, RankFailure):
                raise value.to_exception(rank)
        return results

    def submit(self, method: str, args: tuple[object, ...], deadline: Deadline) -> None:
        """Send `method(*args)` to every rank without waiting; `collect` reads the replies of
        submitted calls in the order they were sent (each rank answers its calls in order)."""
        if self.is_broken:
            raise RankDeadError("the ranks' connections failed earlier; restart the workers")
        self._drop_owed_if_interrupted(deadline)
        if self._unread and not self._submitted:
            logger.warning("dropping the replies of an interrupted call")
            self._read_replies("an interrupted call", deadline)
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for rank, conn in enumerate(self._conns):
                self._send(rank, conn, payload)
        except BaseException:
            self.is_broken = True  # some ranks got the call, some did not
            raise
        self._submitted.append((method, deadline))
        self.deadline = self._submitted[0][1]

    def collect(self) -> list[object]:
        """The results of the oldest submitted call, in rank order (a rank's error raised)."""
        method, deadline = self._submitted.popleft()
        self.deadline = deadline
        self._unread = dict(enumerate(self._conns))
        try:
            results = self._read_replies(method, deadline)
        except KeyboardInterrupt:
            self._interrupted = True  # the ranks are fine; the replies owed are dropped later
            raise
        except BaseException:
            self.is_broken = True  # replies are owed and cannot be matched any more
            raise
        finally:
            self.deadline = self._submitted[0][1] if self._submitted else None
        for rank, value in enumerate(results):
            if isinstance(value, RankFailure):
                raise value.to_exception(rank)
        return results

    def _drop_owed_if_interrupted(self, deadline: Deadline) -> None:
        """After an interrupted `collect`: read and drop the rest of its replies, then those of
        every call submitted after it (the caller has given those steps up)."""
        if not self._interrupted:
            return
        logger.warning("dropping the replies of interrupted steps")
        self.is_broken = True  # until every owed reply is read
        self._read_replies("an interrupted step", deadline)
        while self._submitted:
            method, _ = self._submitted.popleft()
            self._unread = dict(enumerate(self._conns))
            self._read_replies(method, deadline)
        self._interrupted = False
        self.is_broken = False
        self.deadline = None

    def check_overdue(self) -> None:
        """RankTimeoutError when the call in flight has passed its deadline."""
        deadline = self.deadline
        if deadline is not None and deadline.remaining() <= 0:
            raise deadline.error("the call in flight")

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

    def _read_replies(self, method: str, deadline: Deadline) -> list[object]:
        results: list[object] = [None] * len(self._conns)
        unread = self._unread
        while unread:
            wait_s = min(_POLL_S, deadline.remaining())
            if wait_s <= 0:
                raise deadline.error(f"tensor-parallel rank(s) {sorted(unread)}: {method!r}")
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
            pass
        until = time.monotonic() + _REASON_WAIT_S
        while time.monotonic() < until:  # the exit is known a moment after the connection closes
            self._check_alive()  # raises with the reason once the process or Ray knows it
            time.sleep(0.05)
        raise RankDeadError(f"tensor-parallel rank {rank} died (its connection closed)")

"""Waiting-queue policies behind one small protocol: FCFS (a deque) and priority (a heap).

The scheduler adds arrivals, puts preempted requests back with `prepend`, and admits from the
head; `make_request_queue` picks the class for a `SchedulingPolicy`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from scheduler.config import SchedulingPolicy
from scheduler.request import Request


class RequestQueue(Protocol):
    """What the scheduler needs from a waiting queue."""

    def add(self, request: Request) -> None:
        """Queue a new arrival."""

    def prepend(self, request: Request) -> None:
        """Put a preempted request back ahead of the arrivals it came before."""

    def peek(self) -> Request:
        """The request to admit next (the queue must not be empty)."""

    def pop(self) -> Request:
        """Remove and return the request `peek` returns."""

    def remove(self, req_ids: Iterable[str]) -> None:
        """Drop these requests (missing IDs are ignored)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; preempted requests go to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, req_ids: Iterable[str]) -> None:
        drop = set(req_ids)
        self._queue = deque(r for r in self._queue if r.req_id not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Smallest (priority, arrival_time) first; ties keep insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        # A preempted request keeps its place by key: its priority decides, not recency.
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req_ids: Iterable[str]) -> None:
        drop = set(req_ids)
        self._heap = [entry for entry in self._heap if entry[3].req_id not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))


def make_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    """The waiting queue for a policy."""
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    return FCFSQueue()

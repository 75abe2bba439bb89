"""`InProcessEngineClient`: the engine in the caller's thread, stepped as its streams are read.

Reading a stream whose queue is empty runs one engine step, which advances every running request
and queues their deltas; a stream closed before its request finished aborts the request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from cluster.engine.client import EngineInfo, engine_info
from cluster.engine.core import EngineCore, build_engine_core
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine_args import EngineArgs
from scheduler.stats import SchedulerStats


class InProcessEngineClient:
    """A blocking `EngineClient` over an engine core in this process."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._queues: dict[str, deque[RequestOutput]] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> InProcessEngineClient:
        return cls(build_engine_core(args))

    def add_request(self, request: EngineRequest) -> Iterator[RequestOutput]:
        self.core.add_request(request)
        self._queues[request.request_id] = deque()
        return self._stream(request.request_id)

    def abort(self, request_id: str) -> None:
        self._publish(self.core.abort([request_id]))

    def step(self) -> None:
        """Run one engine step and queue its deltas."""
        self._publish(self.core.step())

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def check_health(self) -> None:
        self.core.check_health()

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def get_info(self) -> EngineInfo:
        return engine_info(self.core)

    def get_tokenizer(self) -> Any:
        return self.core.tokenizer

    def shutdown(self) -> None:
        self.core.shutdown()

    def _publish(self, deltas: list[RequestOutput]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.append(delta)

    def _stream(self, request_id: str) -> Iterator[RequestOutput]:
        queue = self._queues[request_id]
        finished = False
        try:
            while not finished:
                while not queue:
                    if not self.core.has_unfinished_requests():
                        raise RuntimeError(f"request {request_id!r} left the engine unfinished")
                    self.step()
                delta = queue.popleft()
                finished = delta.finished
                yield delta
        finally:
            del self._queues[request_id]
            if not finished:  # closed early, or a step failed: the request leaves the engine
                self.core.abort([request_id])

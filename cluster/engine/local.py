"""`InProcessEngineClient`: the engine in the caller's thread, stepped as its streams are read.

Reading a stream whose queue is empty runs one engine step, which advances every running request
and queues their deltas; a stream closed before its request finished aborts the request.

A failed step ends every request in flight with `EngineDeadError` at once (the core drops them);
the workers restart before the next request is queued, as the asyncio engine restarts them, so
a lost rank costs the requests in flight and nothing after.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from cluster.config.engine_args import EngineArgs
from cluster.engine.client import EngineInfo, engine_info
from cluster.engine.controls import EngineControls
from cluster.engine.core import EngineCore, build_engine_core
from cluster.engine.errors import EngineDeadError
from cluster.engine.lifecycle import drains_first, run_control
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine.weight_calls import WeightCalls
from cluster.engine.weight_sync import Settled, run_weight_call
from scheduler.stats import SchedulerStats

_StreamItem = RequestOutput | EngineDeadError


class InProcessEngineClient(EngineControls, WeightCalls):
    """A blocking `EngineClient` over an engine core in this process."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._queues: dict[str, deque[_StreamItem]] = {}
        self.needs_restart = False
        """A step failed: the workers restart before the next request is queued."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> InProcessEngineClient:
        return cls(build_engine_core(args))

    def add_request(self, request: EngineRequest) -> Iterator[RequestOutput]:
        self._raise_if_paused()
        if self.needs_restart:
            self.needs_restart = False
            self.core.restart_workers()  # EngineDeadError (the engine dead) when it cannot
        self.core.add_request(request)
        self._queues[request.request_id] = deque()
        return self._stream(request.request_id)

    def abort(self, request_id: str) -> None:
        self._publish(self.core.abort([request_id]))

    def control(self, name: str, *args: object) -> object:
        """Run a control call (`cluster.engine.controls`); mode "wait" first steps the requests
        in the engine to their end (their outputs wait in their streams)."""
        if drains_first(name, args):
            while self.core.has_unfinished_requests():
                self.step()
        result = run_control(self.core, name, *args)
        self._publish(result.deltas)
        return result.value

    def _raise_if_paused(self) -> None:
        if self.core.lifecycle.is_paused:
            raise RuntimeError(
                "the engine is paused or asleep: call wake_up() or resume_generation() first"
            )

    def step(self) -> None:
        """Run one engine step and queue its deltas; a failed step queues its error instead, in
        every request's stream."""
        self._raise_if_paused()
        try:
            deltas = self.core.step()
        except Exception as exc:
            error = self.core.fail_requests(exc)
            self.needs_restart = True
            for queue in self._queues.values():
                queue.append(error)
            return
        self._publish(deltas)

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

    def weight_call(self, name: str, *args: object) -> Any:
        """A weight-transfer call (`cluster.engine.weight_calls`), between two steps."""
        result = run_weight_call(self.core, name, *args)
        if isinstance(result, Settled):
            self._publish(result.deltas)
            return result.value
        return result

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
                item = queue.popleft()
                if isinstance(item, EngineDeadError):
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._queues[request_id]
            if not finished:  # closed early, or a step failed: the request leaves the engine
                self.core.abort([request_id])

"""`AsyncEngine`: an engine core behind an asyncio step loop (the async `EngineClient`).

The loop runs each step in a worker thread, so the event loop keeps streaming the previous
step's outputs to callers (and accepting requests) while the next step computes. Core calls
from the event loop (add, abort, stats) wait for the step in flight through one asyncio lock, so
the scheduler is never used by two threads at once.

    add_request ─► core.add_request ─► wake loop ─► step (thread) ─► deltas ─► request queues

A stream whose reader falls behind gets the deltas queued meanwhile as one merged delta: the
same text and tokens in fewer items. Beyond that, a stream holds its tokens for the interval its
`StreamBatching` policy names for the current load (none while few requests stream, so the
first token and the final chunk are never held, and nothing waits at low load).

A failed step ends every request in flight with `EngineDeadError` at once; the workers then
restart in a thread outside the lock (bounded by `worker_start_timeout_s`), so adds and aborts go
on meanwhile: requests added during the restart wait in the scheduler and run after it (or end
with `EngineDeadError` if it fails, which leaves the engine dead).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from cluster.engine.client import EngineInfo, engine_info
from cluster.engine.controls import AsyncEngineControls
from cluster.engine.core import EngineCore
from cluster.engine.errors import EngineDeadError
from cluster.engine.lifecycle import drains_first, run_control
from cluster.engine.outputs import OutputAccumulator, RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine.stream_batching import HeldChunk, StreamBatching
from cluster.engine.weight_calls import AsyncWeightCalls
from cluster.engine.weight_sync import Settled, run_weight_call
from scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)

_StreamItem = RequestOutput | BaseException
_T = TypeVar("_T")


class AsyncEngine(AsyncEngineControls, AsyncWeightCalls):
    """An asyncio `EngineClient` over an engine core in this process."""

    def __init__(self, core: EngineCore, stream_batching: StreamBatching | None = None) -> None:
        self.core = core
        self.stream_batching = stream_batching or StreamBatching(interval_ms=0)
        """How long a stream holds its tokens (default: nothing held; the Serve replica passes
        its `stream_batching_interval_ms`, adaptive unless set)."""
        self._lock = asyncio.Lock()
        self._has_work = asyncio.Event()
        self._admitting = asyncio.Event()
        """Set while new requests may enter (clear while paused, asleep or draining)."""
        self._admitting.set()
        self._queues: dict[str, asyncio.Queue[_StreamItem]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self.is_restarting = False
        """The workers are being restarted after a failed step (the loop steps again after)."""
        self.num_steps = 0
        self.num_aborted = 0
        """Streams closed before their request finished (the caller went away)."""

    async def add_request(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        self.core.raise_if_dead()
        self._ensure_loop()
        await self.core.structured.compiled_in_background(request.sampling_params)
        await self._admitting.wait()  # paused or asleep: the request waits for the resume
        async with self._lock:
            self.core.add_request(request)  # ValueError or EngineDeadError: nothing was queued
        self._queues[request.request_id] = asyncio.Queue()
        self._has_work.set()
        return self._stream(request.request_id)

    async def abort(self, request_id: str) -> None:
        async with self._lock:
            deltas = self.core.abort([request_id])
        self._publish(deltas)

    async def check_health(self) -> None:
        """Raise when the engine is dead or a worker is dead or stuck (a restart under way has
        its own deadline, so it counts as healthy)."""
        if self.is_restarting:
            self.core.raise_if_dead()
        else:
            self.core.check_health()
        if self._loop_task is not None and self._loop_task.done():
            raise EngineDeadError("the engine's step loop has stopped")

    async def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    async def control(self, name: str, *args: object) -> object:
        """Run a control call (`cluster.engine.controls`) between two steps; mode "wait" first
        lets the requests in the engine finish, new ones waiting at the door."""
        if drains_first(name, args):
            self._admitting.clear()
            while self.core.has_unfinished_requests() and self.core.dead is None:
                await asyncio.sleep(0.005)
        try:
            async with self._lock:
                result = await asyncio.to_thread(run_control, self.core, name, *args)
        finally:
            if self.core.lifecycle.is_paused:
                self._admitting.clear()
            else:
                self._admitting.set()
                self._has_work.set()
        self._publish(result.deltas)
        return result.value

    async def weight_call(self, name: str, *args: object) -> Any:
        """A weight-transfer call (`cluster.engine.weight_calls`), between two steps; the
        deltas of a step it took out of flight reach their streams."""
        async with self._lock:
            result = await asyncio.to_thread(run_weight_call, self.core, name, *args)
        if isinstance(result, Settled):
            self._publish(result.deltas)
            self._has_work.set()  # requests recomputed under the new weights
            return result.value
        return result

    async def call_core(self, function: Callable[..., _T], *args: object) -> _T:
        """`function(core, *args)` between two steps (in a thread, under the step lock)."""
        async with self._lock:
            return await asyncio.to_thread(function, self.core, *args)

    async def get_info(self) -> EngineInfo:
        return engine_info(self.core)

    async def get_tokenizer(self) -> Any:
        return self.core.tokenizer

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self.core.shutdown()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Step while there is work; sleep on the event otherwise."""
        while True:
            await self._has_work.wait()
            async with self._lock:
                if self.core.lifecycle.is_paused or not self.core.has_unfinished_requests():
                    self._has_work.clear()
                    continue
                try:
                    deltas = await asyncio.to_thread(self.core.step)
                except Exception as exc:
                    self._fail_in_flight(self.core.fail_requests(exc))
                    deltas = None
            if deltas is None:
                await self._restart_workers()
                continue
            self.num_steps += 1
            self._publish(deltas)

    async def _restart_workers(self) -> None:
        """Restart the workers outside the lock; if that fails the engine is dead, and the
        requests added meanwhile end with its error."""
        self.is_restarting = True
        try:
            await asyncio.to_thread(self.core.restart_workers)
        except EngineDeadError as dead:
            async with self._lock:
                self.core.drop_all_requests()
                self._fail_in_flight(dead)
        finally:
            self.is_restarting = False

    def _fail_in_flight(self, error: EngineDeadError) -> None:
        """Every request in flight ends with `error` (the core has dropped them already)."""
        for queue in self._queues.values():
            queue.put_nowait(error)

    def _publish(self, deltas: list[RequestOutput]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    async def _stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        queue = self._queues[request_id]
        held = HeldChunk()
        finished = False
        try:
            while not finished:
                error = await self._fill(queue, held)
                if not held.empty:
                    chunk = held.take(time.monotonic())
                    finished = chunk.finished
                    yield chunk
                if error is not None:
                    finished = True
                    raise error
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the caller went away: free the request's blocks
                self.num_aborted += 1
                await asyncio.shield(self.abort(request_id))

    async def _fill(
        self, queue: asyncio.Queue[_StreamItem], held: HeldChunk
    ) -> BaseException | None:
        """Take deltas into `held` until its chunk is due (at once unless the load calls for an
        interval); returns the error that ends the stream, if one arrived."""
        item = await queue.get()
        while True:
            if isinstance(item, BaseException):
                return item
            merged, error = coalesce_queued(item, queue)
            held.add(merged)
            if error is not None or merged.finished:
                return error
            interval_s = self.stream_batching.interval_s(self.num_in_flight)
            wait_s = held.wait_s(time.monotonic(), interval_s)
            if wait_s <= 0:
                return None
            try:
                item = await asyncio.wait_for(queue.get(), wait_s)
            except TimeoutError:
                return None


def coalesce_queued(
    first: RequestOutput, queue: asyncio.Queue[_StreamItem]
) -> tuple[RequestOutput, BaseException | None]:
    """`first` merged with the deltas already queued behind it, and the queued error that ends
    the merge (None when there is none); waits for nothing."""
    if first.finished or queue.empty():
        return first, None
    accumulator = OutputAccumulator()
    merged = accumulator.add(first)
    while not merged.finished and not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, BaseException):
            return merged, item
        merged = accumulator.add(item)
    return merged, None

"""The engine as a Ray actor (`EngineActor`) and the clients that reach it (`RayEngineClient`,
`AsyncRayEngineClient`).

The actor holds an `AsyncEngine` built by `build_engine_core` with a `RayExecutor` (one worker
actor per rank). `generate` is a streaming generator: its first item (None) acknowledges that
the request was queued (or raises the ValueError that refused it), then each step's delta follows
as soon as the step ends, while the next step runs. A stream closed before its request finished
aborts the request in the engine. A caller that falls behind holds the actor's stream back (at
most `STREAM_BACKPRESSURE` items unread), so the deltas wait in the engine and reach it merged into
one item: fewer Ray objects per token, the same text.

    caller ──EngineRequest──► EngineActor.generate ──► AsyncEngine ──► RayExecutor ──► rank actors
           ◄──None, delta, delta, …, final delta──┘
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from cluster.config.engine_args import EngineArgs
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.client import EngineInfo
from cluster.engine.controls import AsyncEngineControls, EngineControls
from cluster.engine.core import build_engine_core
from cluster.engine.errors import EngineDeadError
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.executor.ray import RayExecutor
from cluster.engine.kv_transfer import (
    KVImportResult,
    KVTransfer,
    import_within,
    kv_export,
    kv_held_keys,
    transfer_counters,
)
from cluster.engine.kv_transfer_counters import KVTransferCounters
from cluster.engine.lifecycle import CONTROL_NAMES
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine.weight_calls import AsyncWeightCalls, WeightCalls
from cluster.engine.weight_sync import WEIGHT_CALLS
from cluster.ray_cluster import connect
from scheduler.kv_cache.transfer import HeldKeys
from scheduler.stats import SchedulerStats
from worker.kv_io.kv_direct import SEND_TIMEOUT_S

logger = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT_S = 30.0
STREAM_BACKPRESSURE = 2
"""Unread items a `generate` stream may run ahead of its caller before it waits."""
_STREAM_OPTIONS = {
    "num_returns": "streaming",
    "_generator_backpressure_num_objects": STREAM_BACKPRESSURE,
}


class EngineActor(AsyncWeightCalls):
    """The central engine: scheduler, hybrid KV coordinator and Ray executor, asyncio loop."""

    def __init__(self) -> None:
        self._engine: AsyncEngine | None = None
        self._executor: RayExecutor | None = None

    async def start(self, args: EngineArgs, placement: PlacementSpec | None) -> EngineInfo:
        """Start the workers and the KV cache; the model's info."""

        def build() -> AsyncEngine:
            self._executor = RayExecutor(args, placement)
            return AsyncEngine(build_engine_core(args, self._executor))

        self._engine = await asyncio.to_thread(build)
        return await self._engine.get_info()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput | None]:
        """None once the request is queued, then its deltas up to the finished one."""
        stream = await self.engine.add_request(request)
        yield None
        async for delta in stream:
            yield delta

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def get_stats(self) -> SchedulerStats:
        return await self.engine.get_stats()

    async def get_info(self) -> EngineInfo:
        return await self.engine.get_info()

    async def control(self, name: str, *args: object) -> object:
        """A control call (sleep, wake_up, pause, collective_rpc: `cluster.engine.controls`)."""
        if name not in CONTROL_NAMES:
            raise ValueError(f"unknown engine control call {name!r}")
        return await self.engine.control(name, *args)

    async def weight_call(self, name: str, *args: object) -> Any:
        """A weight-transfer call (`cluster.engine.weight_calls`)."""
        if name not in WEIGHT_CALLS:
            raise ValueError(f"unknown weight call {name!r}")
        return await self.engine.weight_call(name, *args)

    async def kv_held_keys(self, prompt_token_ids: list[int], cache_salt: str | None) -> HeldKeys:
        """KV transfer, receiver: which of the prompt's blocks this engine holds."""
        return await self.engine.call_core(kv_held_keys, prompt_token_ids, cache_salt)

    async def kv_export(
        self,
        prompt_token_ids: list[int],
        held: HeldKeys,
        cache_salt: str | None,
        timeout_s: float = SEND_TIMEOUT_S,
    ) -> KVTransfer:
        """KV transfer, sender: the cached prefix blocks the receiver lacks (an offer of
        them waits `timeout_s` for the receiver)."""
        return await self.engine.call_core(
            kv_export, prompt_token_ids, held, cache_salt, False, timeout_s
        )

    async def kv_transfer_counters(self) -> KVTransferCounters:
        """This engine's transfer counters (a copy, its ranks' direct sends read in)."""
        return await self.engine.call_core(transfer_counters)

    async def kv_import(
        self, transfer: KVTransfer, timeout_s: float = SEND_TIMEOUT_S
    ) -> KVImportResult:
        """KV transfer, receiver: take the pages (an offer's within `timeout_s`, before the
        engine's lock), then the blocks into the pool and prefix cache."""
        return await import_within(self.engine, transfer, timeout_s)

    async def get_tokenizer(self) -> Any:
        return await self.engine.get_tokenizer()

    async def worker_actor_names(self) -> list[str]:
        """Names of the rank actors (for operators and fault-injection tests)."""
        return self._executor.actor_names if self._executor is not None else []

    async def delay_steps(self, seconds: float, ranks: list[int] | None = None) -> None:
        """Test hook: the ranks (all, or `ranks`) sleep `seconds` before each later step."""
        assert self._executor is not None
        await asyncio.to_thread(self._executor.delay_steps, seconds, ranks)

    async def owned_placement_group(self) -> PlacementGroup | None:
        """The placement group this engine created for its ranks (None: it runs in its
        caller's), so a caller can remove it should this actor die before doing so itself."""
        return self._executor.owned_placement_group if self._executor is not None else None

    async def shutdown(self) -> None:
        """Stop the step loop, the rank actors and the placement group."""
        if self._engine is not None:
            await self._engine.shutdown()
            self._engine = None

    @property
    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise RuntimeError("the engine has not started (or has been shut down)")
        return self._engine


_RemoteEngine: Any = ray.remote(num_cpus=0, max_restarts=0)(EngineActor)


def start_engine_actor(
    args: EngineArgs, address: str | None = None, placement: PlacementSpec | None = None
) -> tuple[Any, EngineInfo]:
    """Connect to Ray if needed, start an engine actor; (handle, info). Nothing is left behind
    on failure (a ValueError for bad arguments or an unsatisfiable placement)."""
    connect(address)
    name = f"hybridserve-engine-{uuid.uuid4().hex[:8]}"
    actor = _RemoteEngine.options(name=name).remote()
    try:
        info = _get(actor.start.remote(args, placement))
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    return actor, info


def stop_engine_actor(actor: Any, group: PlacementGroup | None = None) -> None:
    """Shut the engine down (its workers and placement group go with it), then kill it; when
    it cannot shut down (it died), remove its placement group `group` here (Ray keeps a group
    until the job that made it ends, not the actor)."""
    if not ray.is_initialized():  # Ray shut down first: the actor went with it
        return
    try:
        ray.get(actor.shutdown.remote(), timeout=_SHUTDOWN_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        logger.warning("engine actor did not shut down cleanly: %s", _first_line(exc))
        if group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
    ray.kill(actor, no_restart=True)


class RayEngineClient(EngineControls, WeightCalls):
    """A blocking `EngineClient` on an engine actor."""

    def __init__(self, actor: Any, info: EngineInfo) -> None:
        self.actor = actor
        self.info = info
        self._is_shut_down = False
        self.placement_group: PlacementGroup | None = _get(actor.owned_placement_group.remote())

    @classmethod
    def start(
        cls, args: EngineArgs, address: str | None = None, placement: PlacementSpec | None = None
    ) -> RayEngineClient:
        """Start an engine actor on the Ray cluster at `address` ("auto", "ray://host:port")."""
        return cls(*start_engine_actor(args, address, placement))

    def add_request(self, request: EngineRequest) -> Iterator[RequestOutput]:
        stream = self.actor.generate.options(**_STREAM_OPTIONS).remote(request)
        _get(next(stream))  # the acknowledgement, or the ValueError that refused the request
        return self._read(stream, request.request_id)

    def abort(self, request_id: str) -> None:
        _get(self.actor.abort.remote(request_id))

    def check_health(self) -> None:
        _get(self.actor.check_health.remote())

    def get_stats(self) -> SchedulerStats:
        stats: SchedulerStats = _get(self.actor.get_stats.remote())
        return stats

    def get_info(self) -> EngineInfo:
        return self.info

    def get_tokenizer(self) -> Any:
        return _get(self.actor.get_tokenizer.remote())

    def control(self, name: str, *args: object) -> Any:
        return _get(self.actor.control.remote(name, *args))

    def weight_call(self, name: str, *args: object) -> Any:
        return _get(self.actor.weight_call.remote(name, *args))

    def async_client(self) -> AsyncRayEngineClient:
        """An asyncio client on the same engine actor."""
        return AsyncRayEngineClient(self.actor, self.info, self.placement_group)

    def shutdown(self) -> None:
        if not self._is_shut_down:
            self._is_shut_down = True
            stop_engine_actor(self.actor, self.placement_group)

    def _read(self, stream: Any, request_id: str) -> Iterator[RequestOutput]:
        finished = False
        try:
            for ref in stream:
                finished = True  # an error from the engine ends the request there
                delta: RequestOutput = _get(ref)
                finished = delta.finished
                yield delta
        finally:
            if not finished:  # closed early: the request leaves the engine now
                ray.cancel(stream)
                self.abort(request_id)


class AsyncRayEngineClient(AsyncEngineControls, AsyncWeightCalls):
    """An asyncio `AsyncEngineClient` on an engine actor."""

    def __init__(
        self, actor: Any, info: EngineInfo, placement_group: PlacementGroup | None = None
    ) -> None:
        self.actor = actor
        self.info = info
        self.placement_group = placement_group

    async def add_request(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        stream = self.actor.generate.options(**_STREAM_OPTIONS).remote(request)
        await _aget(await stream.__anext__())
        return self._read(stream, request.request_id)

    async def abort(self, request_id: str) -> None:
        await _aget(self.actor.abort.remote(request_id))

    async def check_health(self) -> None:
        await _aget(self.actor.check_health.remote())

    async def get_stats(self) -> SchedulerStats:
        stats: SchedulerStats = await _aget(self.actor.get_stats.remote())
        return stats

    async def get_info(self) -> EngineInfo:
        return self.info

    async def get_tokenizer(self) -> Any:
        return await _aget(self.actor.get_tokenizer.remote())

    async def control(self, name: str, *args: object) -> Any:
        return await _aget(self.actor.control.remote(name, *args))

    async def weight_call(self, name: str, *args: object) -> Any:
        return await _aget(self.actor.weight_call.remote(name, *args))

    async def shutdown(self) -> None:
        await asyncio.to_thread(stop_engine_actor, self.actor, self.placement_group)

    async def _read(self, stream: Any, request_id: str) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            async for ref in stream:
                finished = True  # an error from the engine ends the request there
                delta: RequestOutput = await _aget(ref)
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                ray.cancel(stream)
                await asyncio.shield(self.abort(request_id))


def _get(ref: Any) -> Any:
    try:
        return ray.get(ref)
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
        raise _user_error(exc) from None


async def _aget(ref: Any) -> Any:
    try:
        return await ref
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
        raise _user_error(exc) from None


def _user_error(exc: ray.exceptions.RayError) -> BaseException:
    """The engine's own exception (ValueError, EngineDeadError, ...) without Ray's wrapping; the
    engine actor's death (died, or its node unreachable) as one line of EngineDeadError."""
    if isinstance(exc, ray.exceptions.RayActorError):
        reason = _first_line(exc)
        return EngineDeadError(f"the engine actor is gone ({reason}); start a new LLM")
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else None
    if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
        return cause
    return RuntimeError(_first_line(exc))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__

"""`BatchService`: the Files and Batch APIs' state, and the batches running in the background.

One detached Ray actor per Serve application (`batches:<app>`), created by the first Files or
Batch request; every ingress replica talks to it. It keeps files and batches in a `BatchStore`
and runs each batch as an asyncio task: the lines go to the model deployments through Serve
handles (so Serve spreads them over the engine replicas), in prefix groups, at most `window` at
once, each with `BATCH_PRIORITY` added to its priority, so interactive requests go first.

Nothing is lost: each finished line is recorded in the batch's progress log before it counts. A
line whose replica dies (or that meets a replica shutting down) is sent again, up to
`MAX_ATTEMPTS` times; a service that restarts (over a folder store) resumes its unfinished
batches from their logs. Cancelling stops the lines in flight at once and writes the finished
ones out. Status: validating -> in_progress -> finalizing -> completed | failed | cancelled |
expired (a batch past its completion window keeps its finished lines; the others are error
lines `batch_expired`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RayServeException

from cluster.config.lora import served_model
from cluster.openai_api.batch_protocol import (
    BATCH_PRIORITY,
    COMPLETION_WINDOWS,
    TERMINAL_STATUSES,
    BatchCreateRequest,
    BatchErrorItem,
    BatchErrors,
    BatchLine,
    BatchObject,
    BatchRequestCounts,
    FileObject,
    failure_line,
    invalid_line,
    is_success,
    new_id,
    non_jsonl_reason,
    now,
    read_batch_lines,
    success_line,
)
from cluster.openai_api.protocol import ErrorInfo, ErrorResponse
from cluster.serve import errors
from cluster.serve.batch_dispatch import Order, dispatch
from cluster.serve.batch_store import BatchStore, Blobs

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 5
"""Sends of one line before it fails as unavailable (its replica died each time)."""
RETRY_DELAY_S = 0.5
Models = dict[str, tuple[str, str]]
"""Served model ID -> (application, deployment) of its engine replicas."""
RESUMABLE = ("validating", "in_progress", "finalizing", "cancelling")
_TRANSIENT = (RayActorError, RayServeException, BackPressureError)


class BatchService:
    """The body of the `batches:<app>` actor (asyncio: every call runs on its event loop)."""

    def __init__(self, models: Models, blobs: Blobs, window: int, order: Order = "prefix") -> None:
        self.models = models
        self.store = BatchStore(blobs)
        self.window = window
        self.order: Order = order
        self.live: dict[str, BatchObject] = {}
        """Batches running here: their record with current counts (saved at each status)."""
        self.runs: dict[str, asyncio.Task[None]] = {}
        self._resumed = False
        self.handles: dict[tuple[str, str], Any] = {}
        self._watcher: asyncio.Task[None] | None = None

    # -- files -----------------------------------------------------------------------------------

    async def create_file(self, filename: str, purpose: str, content: bytes) -> FileObject:
        self._resume()
        info = FileObject(
            id=new_id("file"),
            bytes=len(content),
            created_at=now(),
            filename=filename,
            purpose=purpose,  # type: ignore[arg-type]
        )
        self.store.add_file(info, content)
        return info

    async def files(self) -> list[FileObject]:
        self._resume()
        return self.store.files()

    async def file(self, file_id: str) -> FileObject | None:
        return self.store.file(file_id)

    async def content(self, file_id: str) -> bytes | None:
        return self.store.content(file_id)

    async def delete_file(self, file_id: str) -> bool:
        return self.store.delete_file(file_id)

    # -- batches ---------------------------------------------------------------------------------

    async def create_batch(
        self, request: BatchCreateRequest, models: Models
    ) -> BatchObject | ErrorResponse:
        self._resume()
        self.models = models
        info = self.store.file(request.input_file_id)
        if info is None:
            return errors.error_response(
                f"no file {request.input_file_id!r}", 404, param="input_file_id"
            )
        if info.purpose != "batch":
            message = f"file {info.id} has purpose {info.purpose!r}; a batch input needs 'batch'"
            return errors.bad_request(message, param="input_file_id")
        created = now()
        batch = BatchObject(
            id=new_id("batch"),
            endpoint=request.endpoint,
            input_file_id=request.input_file_id,
            completion_window=request.completion_window,
            created_at=created,
            expires_at=created + COMPLETION_WINDOWS[request.completion_window],
            metadata=request.metadata,
        )
        self._save(batch)
        self._start(batch.id)
        return batch

    async def batch(self, batch_id: str) -> BatchObject | None:
        self._resume()
        return self.live.get(batch_id) or self.store.batch(batch_id)

    async def batches(self) -> list[BatchObject]:
        self._resume()
        return [self.live.get(batch.id, batch) for batch in self.store.batches()]

    async def cancel(self, batch_id: str) -> BatchObject | ErrorResponse:
        batch = await self.batch(batch_id)  # (resumes first)
        if batch is None:
            return errors.error_response(f"no batch {batch_id!r}", 404)
        if batch.finished or batch.status == "cancelling":
            return batch
        self._save(batch.model_copy(update={"status": "cancelling", "cancelling_at": now()}))
        run = self.runs.get(batch_id)
        if run is not None:
            run.cancel()
        return self.live[batch_id]

    # -- running ---------------------------------------------------------------------------------

    def _save(self, batch: BatchObject) -> None:
        self.store.save_batch(batch)
        if batch.finished:
            self.live.pop(batch.id, None)
        else:
            self.live[batch.id] = batch

    def _update(self, batch_id: str, **fields: Any) -> BatchObject:
        batch = self.live[batch_id].model_copy(update=fields)
        self._save(batch)
        return batch

    def _resume(self) -> None:
        """Once, at the first call: run again the batches a previous service left unfinished,
        and start watching the application (the service ends with it)."""
        if self._resumed:
            return
        self._resumed = True
        app = next(iter(self.models.values()), ("", ""))[0]
        if app:
            self._watcher = asyncio.get_running_loop().create_task(_exit_when_app_is_gone(app))
        for batch in self.store.batches():
            if batch.status in RESUMABLE:
                logger.info("resuming batch %s (%s)", batch.id, batch.status)
                self.live[batch.id] = batch
                self._start(batch.id)

    def _start(self, batch_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._run(batch_id))
        self.runs[batch_id] = task
        task.add_done_callback(lambda _: self.runs.pop(batch_id, None))

    async def _run(self, batch_id: str) -> None:
        batch = self.live[batch_id]
        content = self.store.content(batch.input_file_id) or b""
        reason = non_jsonl_reason(content)
        if reason is not None:
            failure = BatchErrorItem(code="invalid_file", message=reason, param="input_file_id")
            self._update(
                batch_id, status="failed", failed_at=now(), errors=BatchErrors(data=[failure])
            )
            return
        lines = read_batch_lines(content.decode("utf-8"), batch.endpoint)
        finished = self.store.finished_lines(batch_id)
        if batch.status in ("validating", "in_progress"):
            fields: dict[str, Any] = {
                "status": "in_progress",
                "in_progress_at": batch.in_progress_at or now(),
            }
            self._update(batch_id, **fields, request_counts=_counts(len(lines), finished))
        try:
            if self.live[batch_id].status == "in_progress":
                await self._run_lines(batch_id, lines, finished)
            status = "cancelled" if self.live[batch_id].status == "cancelling" else "completed"
        except asyncio.CancelledError:
            status = "cancelled"
        except asyncio.TimeoutError:
            status = "expired"
        self._finalize(batch_id, lines, finished, status)

    async def _run_lines(
        self, batch_id: str, lines: list[BatchLine], finished: dict[int, dict[str, Any]]
    ) -> None:
        def done(line: BatchLine, output_line: dict[str, Any]) -> None:
            self.store.record_line(batch_id, line.index, output_line)
            finished[line.index] = output_line
            self.live[batch_id] = self.live[batch_id].model_copy(
                update={"request_counts": _counts(len(lines), finished)}
            )

        todo = [line for line in lines if line.index not in finished]
        for line in todo:
            if line.error is not None:
                done(line, invalid_line(line, f"{batch_id}-{line.index}"))
        runnable = [line for line in todo if line.error is None]

        async def send(line: BatchLine) -> dict[str, Any]:
            return await self._send(batch_id, line)

        left_s = (self.live[batch_id].expires_at or now()) - now()
        await asyncio.wait_for(
            dispatch(runnable, send, done, self.window, self.order), max(left_s, 0)
        )

    async def _send(self, batch_id: str, line: BatchLine) -> dict[str, Any]:
        """The line's output line, from the model deployment its `model` names."""
        request_id = f"{batch_id}-{line.index}"
        request = line.request()
        request = request.model_copy(update={"priority": request.priority + BATCH_PRIORITY})
        served = served_model(request.model, self.models) if request.model else None
        if served is None and (request.model is not None or len(self.models) != 1):
            error = errors.model_not_found(request.model or "")
            return failure_line(line.custom_id, request_id, error.error, error.status)
        app, deployment = self.models[served[0]] if served else next(iter(self.models.values()))
        last: ErrorResponse | None = None
        for _ in range(MAX_ATTEMPTS):
            item = await self._call(app, deployment, request, request_id)
            if isinstance(item, ErrorResponse):
                if item.status != 503:
                    return failure_line(line.custom_id, request_id, item.error, item.status)
                last = item
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            return success_line(line.custom_id, request_id, item.model_dump(mode="json"))
        assert last is not None
        return failure_line(line.custom_id, request_id, last.error, last.status)

    async def _call(self, app: str, deployment: str, request: Any, request_id: str) -> Any:
        """One try: the response body, or an ErrorResponse (503 when the replica went away)."""
        if (deployment, app) not in self.handles:
            handle = await asyncio.to_thread(_deployment_handle, deployment, app)
            self.handles[(deployment, app)] = handle
        handle = self.handles[(deployment, app)]
        stream = handle.options(stream=True).generate.remote(request, request_id, False)
        try:
            return await stream.__anext__()
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except StopAsyncIteration:
            return errors.error_response("the model returned nothing", 500)
        except _TRANSIENT as error:
            logger.warning(
                "batch line %s: replica unavailable (%s); sending it again", request_id, error
            )
            return errors.unavailable(f"the model is unavailable: {_first_line(error)}")

    def _finalize(
        self,
        batch_id: str,
        lines: list[BatchLine],
        finished: dict[int, dict[str, Any]],
        status: str,
    ) -> None:
        self._update(batch_id, status="finalizing", finalizing_at=now())
        outputs: list[dict[str, Any]] = []
        failures: list[dict[str, Any]] = []
        for line in lines:
            output_line = finished.get(line.index)
            if output_line is None and status == "expired":
                output_line = _expired_line(line, f"{batch_id}-{line.index}")
            if output_line is not None:
                (outputs if is_success(output_line) else failures).append(output_line)
        output_id = self._output_file(batch_id, "output", outputs)
        error_id = self._output_file(batch_id, "errors", failures)
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[
            status
        ]
        self._update(
            batch_id,
            status=status,
            output_file_id=output_id,
            error_file_id=error_id,
            request_counts=_counts(len(lines), finished),
            **{stamp: now()},
        )

    def _output_file(
        self, batch_id: str, kind: str, output_lines: list[dict[str, Any]]
    ) -> str | None:
        if not output_lines:
            return None
        content = "".join(json.dumps(line) + "\n" for line in output_lines).encode()
        info = FileObject(
            id=new_id("file"),
            bytes=len(content),
            created_at=now(),
            filename=f"{batch_id}_{kind}.jsonl",
            purpose="batch_output",
        )
        self.store.add_file(info, content)
        return info.id

    def __del__(self) -> None:
        for task in list(self.runs.values()):
            with contextlib.suppress(RuntimeError):
                task.cancel()


def _counts(total: int, finished: dict[int, dict[str, Any]]) -> BatchRequestCounts:
    completed = sum(1 for line in finished.values() if is_success(line))
    return BatchRequestCounts(total=total, completed=completed, failed=len(finished) - completed)


def _expired_line(line: BatchLine, request_id: str) -> dict[str, Any]:
    message = "This request could not be executed before the completion window expired."
    info = ErrorInfo(message=message, type="invalid_request_error", code="batch_expired")
    return failure_line(line.custom_id, request_id, info, 408, line.index + 1)


APP_CHECK_INTERVAL_S = 2.0
"""How often the service checks that its application still exists."""


def _app_exists(app: str) -> bool:
    """Whether Serve still runs `app` (not deleted, not being deleted)."""
    from ray import serve

    try:
        status = serve.status().applications.get(app)
    except Exception:  # Serve itself is gone (or unreachable): so is the app
        logger.warning("batch service of %s: cannot reach Serve", app, exc_info=True)
        return False
    return status is not None and status.status != "DELETING"


async def _exit_when_app_is_gone(app: str) -> None:
    """End this actor once its application is deleted: the service lives as long as the app
    (its folder store, when it has one, lets the next app of that name resume its batches)."""
    import ray

    misses = 0
    while True:
        await asyncio.sleep(APP_CHECK_INTERVAL_S)
        misses = 0 if await asyncio.to_thread(_app_exists, app) else misses + 1
        if misses >= 2:  # twice in a row: not a controller restarting
            logger.info("application %s is gone: its batch service ends", app)
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
            return


def _deployment_handle(deployment: str, app: str) -> Any:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


__all__ = ["TERMINAL_STATUSES", "BatchService", "Models"]


SERVICE_NAMESPACE = "hybridserve"
WINDOW_ENV = "HYBRIDSERVE_BATCH_WINDOW"
DEFAULT_WINDOW = 32
"""Batch lines in flight at once (over all the model's replicas)."""


def served_models() -> Models:
    """The models this Serve replica routes to, with their deployments: the ingress's handles
    (two hops), or the replica's own deployment (one hop)."""
    from ray import serve

    context = serve.get_replica_context()
    replica: Any = context.servable_object
    servers = getattr(replica, "servers", None) or {}
    if servers:
        return {model: (h.app_name, h.deployment_name) for model, h in servers.items()}
    return {replica.server.model_id: (context.app_name, context.deployment)}


_services: dict[str, Any] = {}
"""The service actor of each application, as this process found or created it."""


def service_for_this_app() -> Any:
    """The `batches:<app>` actor of this replica's application, created on first use and then
    kept by this process (detached: it outlives the replica that created it, and ends when the
    application is deleted; with a folder store, a new one resumes what it left)."""
    from ray import serve

    app = serve.get_replica_context().app_name
    if app not in _services:
        _services[app] = _get_or_create_service(app)
    return _services[app]


async def ask_service(method: str, *args: Any) -> Any:
    """`method(*args)` on this application's service; once more on a new actor if the kept one
    has ended (an application deleted and deployed again under its name)."""
    from ray import serve

    app = serve.get_replica_context().app_name
    try:
        return await getattr(await _service_off_loop(), method).remote(*args)
    except RayActorError:
        _services.pop(app, None)
        return await getattr(await _service_off_loop(), method).remote(*args)


async def _service_off_loop() -> Any:
    """`service_for_this_app()`; its first lookup (a call to Ray's control store) in a thread."""
    from ray import serve

    if serve.get_replica_context().app_name in _services:
        return service_for_this_app()
    return await asyncio.to_thread(service_for_this_app)


def _get_or_create_service(app: str) -> Any:
    import ray

    from cluster.serve.batch_store import blobs_from_env

    window = int(os.environ.get(WINDOW_ENV, DEFAULT_WINDOW))
    actor: Any = ray.remote(BatchService)
    return actor.options(
        name=service_name(app),
        namespace=SERVICE_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        # Not in the creating replica's placement group (a one-hop model replica has one): the
        # group, and every actor in it, goes away with that replica.
        scheduling_strategy="DEFAULT",
    ).remote(served_models(), blobs_from_env(), window)


def service_name(app: str) -> str:
    return f"batches:{app}"

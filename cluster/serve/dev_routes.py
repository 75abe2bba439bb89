"""The development routes of the OpenAI ingress, under vLLM's paths: sleep, wake, pause and resume,
prefix-cache reset and collective RPC on a model's engine.

They answer only where `HYBRIDSERVE_SERVER_DEV_MODE=1` is set in the ingress replica's
environment (its `ray_actor_options.runtime_env.env_vars`, or the environment Ray started in),
as vLLM's `VLLM_SERVER_DEV_MODE`; otherwise they are 404s like any unknown path. They let any
client stop the engine or run worker methods: never in production. A call reaches the model's
deployment through its handle, so one replica (as vLLM's one engine); several models: `?model=`.

    POST /sleep?level=1&mode=abort       POST /wake_up?tags=weights&tags=kv_cache
    GET  /is_sleeping                    POST /pause?mode=abort&clear_cache=true
    POST /resume                         GET  /is_paused
    POST /reset_prefix_cache             POST /collective_rpc {method, args, kwargs, timeout}
    POST /init_weight_transfer_engine {init_info}      POST /start_weight_update
    POST /update_weights {update_info: {weights_path}} POST /finish_weight_update {weight_version}
    GET  /get_weight_version

Over HTTP an update comes from a checkpoint folder (`weights_path`); a trainer's in-memory
shards take the Python calls (`cluster.engine.weight_calls`).

Bad input (an unknown mode, level, tag or worker method) is a 400 whose message is one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from ray.serve.handle import DeploymentHandle

from cluster.config.env import server_dev_mode_from_env
from cluster.engine.lifecycle import (
    check_pause_mode,
    check_sleep_level,
    check_wake_tags,
    rpc_call,
)
from cluster.openai_api.protocol import ErrorResponse
from cluster.serve import errors

router = APIRouter()


class DevRoutes:
    """The development routes (a part of the ingress class; `route` picks the model)."""

    route: Callable[[str | None], DeploymentHandle[Any] | ErrorResponse]
    """The deployment serving a request's model, or the error (the ingress class defines it)."""

    @router.post("/sleep", include_in_schema=False)
    async def dev_sleep(
        self, level: str = "1", mode: str = "abort", model: str | None = None
    ) -> Response:
        return await self._call(model, "sleep", lambda: (_level(level), check_pause_mode(mode)))

    @router.post("/wake_up", include_in_schema=False)
    async def dev_wake_up(
        self, tags: Annotated[list[str] | None, Query()] = None, model: str | None = None
    ) -> Response:
        return await self._call(model, "wake_up", lambda: (check_wake_tags(tags or None),))

    @router.get("/is_sleeping", include_in_schema=False)
    async def dev_is_sleeping(self, model: str | None = None) -> Response:
        return await self._call(model, "is_sleeping", tuple, "is_sleeping")

    @router.post("/pause", include_in_schema=False)
    async def dev_pause(
        self, mode: str = "abort", clear_cache: bool = True, model: str | None = None
    ) -> Response:
        args = lambda: (check_pause_mode(mode), clear_cache)  # noqa: E731
        return await self._call(model, "pause_generation", args, status="paused")

    @router.post("/resume", include_in_schema=False)
    async def dev_resume(self, model: str | None = None) -> Response:
        return await self._call(model, "resume_generation", tuple, status="resumed")

    @router.get("/is_paused", include_in_schema=False)
    async def dev_is_paused(self, model: str | None = None) -> Response:
        return await self._call(model, "is_paused", tuple, "is_paused")

    @router.post("/reset_prefix_cache", include_in_schema=False)
    async def dev_reset_prefix_cache(self, model: str | None = None) -> Response:
        return await self._call(model, "reset_prefix_cache", tuple, "reset")

    @router.post("/collective_rpc", include_in_schema=False)
    async def dev_collective_rpc(self, raw: Request, model: str | None = None) -> Response:
        body = await _json_object(raw)
        if isinstance(body, ErrorResponse):
            return _error(body)

        def args() -> tuple[object, ...]:
            method = body.get("method")
            if not isinstance(method, str):
                raise ValueError("collective_rpc needs 'method': the name of a worker method")
            call_args, kwargs = body.get("args", []), body.get("kwargs", {})
            if not isinstance(call_args, list) or not isinstance(kwargs, dict):
                raise ValueError("collective_rpc 'args' must be a list and 'kwargs' an object")
            return rpc_call(method, call_args, kwargs), body.get("timeout")

        return await self._call(model, "collective_rpc", args, "results")

    @router.post("/init_weight_transfer_engine", include_in_schema=False)
    async def dev_init_weight_transfer_engine(
        self, raw: Request, model: str | None = None
    ) -> Response:
        body = await _json_object(raw)
        if isinstance(body, ErrorResponse):
            return _error(body)
        info = lambda: (_object(body.get("init_info", {}), "init_info"),)  # noqa: E731
        return await self._call(model, "init_weight_transfer_engine", info, via="weight_call")

    @router.post("/start_weight_update", include_in_schema=False)
    async def dev_start_weight_update(self, model: str | None = None) -> Response:
        return await self._call(model, "start_weight_update", tuple, via="weight_call")

    @router.post("/update_weights", include_in_schema=False)
    async def dev_update_weights(self, raw: Request, model: str | None = None) -> Response:
        body = await _json_object(raw)
        if isinstance(body, ErrorResponse):
            return _error(body)

        def args() -> tuple[object, ...]:
            info = _object(body.get("update_info", body), "update_info")
            if not isinstance(info.get("weights_path"), str):
                raise ValueError("update_weights over HTTP needs update_info.weights_path")
            return ({"weights_path": info["weights_path"]},)

        return await self._call(model, "update_weights", args, "bytes_received", via="weight_call")

    @router.post("/finish_weight_update", include_in_schema=False)
    async def dev_finish_weight_update(self, raw: Request, model: str | None = None) -> Response:
        body = await _json_object(raw)
        if isinstance(body, ErrorResponse):
            return _error(body)
        version = lambda: (body.get("weight_version"),)  # noqa: E731
        return await self._call(
            model, "finish_weight_update", version, "weight_version", via="weight_call"
        )

    @router.get("/get_weight_version", include_in_schema=False)
    async def dev_get_weight_version(self, model: str | None = None) -> Response:
        return await self._call(
            model, "get_weight_version", tuple, "weight_version", via="weight_call"
        )

    async def _call(
        self,
        model: str | None,
        name: str,
        args: Any,
        answer_key: str | None = None,
        status: str | None = None,
        via: str = "control",
    ) -> Response:
        """Check the arguments (`args()`), run the control call on the model's deployment and
        answer as vLLM's route does."""
        if not server_dev_mode_from_env():
            return _error(errors.error_response("Not Found", 404))
        try:
            value = await self._control(model, name, args(), via)
        except (ValueError, TypeError) as error:
            return _error(errors.bad_request(_one_line(error)))
        except Exception as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, (ValueError, TypeError)):
                return _error(errors.bad_request(_one_line(cause)))
            return _error(errors.error_response(_one_line(error), 500))
        if isinstance(value, ErrorResponse):
            return _error(value)
        if status is not None:
            return JSONResponse({"status": status})
        if answer_key is None:
            return Response(status_code=200)
        return JSONResponse({answer_key: _jsonable(value)})

    async def _control(
        self, model: str | None, name: str, args: tuple[object, ...], via: str = "control"
    ) -> object:
        """The call on the model's engine (`via`: control or weight_call): this replica's own
        (one hop) or over its handle."""
        local = getattr(self, "server", None)
        if local is not None:
            return await getattr(local, via)(name, *args)
        handle = self.route(model)
        if isinstance(handle, ErrorResponse):
            return handle
        return await getattr(handle, via).remote(name, *args)


def _object(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object")
    return value


def _level(level: str) -> int:
    try:
        return check_sleep_level(int(level))
    except ValueError:
        raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}") from None


async def _json_object(raw: Request) -> dict[str, Any] | ErrorResponse:
    try:
        body = json.loads(await raw.body() or b"{}")
    except json.JSONDecodeError as error:
        return errors.bad_request(f"the body is not JSON: {error}")
    if not isinstance(body, dict):
        return errors.bad_request("the body must be a JSON object")
    return body


def _jsonable(value: object) -> object:
    """Results as vLLM's route gives them: JSON values as they are, others as text."""
    if isinstance(value, list):
        return [
            item if item is None or isinstance(item, (dict, list)) else str(item) for item in value
        ]
    return value


def _one_line(error: BaseException) -> str:
    lines = str(getattr(error, "cause", None) or error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _error(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.status)

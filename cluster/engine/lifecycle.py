"""Pause, sleep and wake of an engine (vLLM's control surface for RL rollouts), run on the core
between two steps.

    running ──pause_generation / sleep(0)──► paused ──resume_generation / wake_up──► running
    running ──sleep(1|2)──► paused, ranks asleep {weights, kv_cache} ──wake_up(tags)──► ...

Scheduling resumes once every rank's memory is back (as vLLM: a partial wake, `tags=["weights"]`,
keeps the engine paused; `["scheduling"]` alone resumes only a level-0 sleep). `is_sleeping` is
true while paused or asleep, as vLLM's.

What `mode` (vLLM's PauseMode) does with the requests in the engine:
  abort  they end at once (finish reason "abort");
  wait   the client lets them finish first (new ones wait at its door), then pauses;
  keep   they stay; a sleep that releases the KV pool preempts them, so after the wake their KV
         is recomputed from their tokens (`scheduler.pause`); a pause keeps their KV.
The prefix cache (device pool and offload tier) is reset by every sleep of level 1 or 2 and by
a pause with `clear_cache` (which then preempts kept requests too, as vLLM's reset of running
requests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

import cloudpickle  # type: ignore[import-untyped]

from cluster.engine.lifecycle_state import Lifecycle
from cluster.engine.outputs import RequestOutput
from cluster.engine.weight_sync import ENGINE_RPC_METHODS, engine_rpc
from scheduler.pause import preempt_all
from worker.rpc import RpcCall

if TYPE_CHECKING:
    from cluster.engine.core import EngineCore

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)
MEMORY_TAGS = ("weights", "kv_cache")
WAKE_TAGS = (*MEMORY_TAGS, "scheduling")
CONTROL_NAMES = frozenset(
    {
        "sleep",
        "wake_up",
        "is_sleeping",
        "pause_generation",
        "resume_generation",
        "is_paused",
        "reset_prefix_cache",
        "collective_rpc",
    }
)
"""The calls `run_control` answers (and the engine actor and Serve replica forward)."""

__all__ = ["CONTROL_NAMES", "Lifecycle", "PauseMode", "run_control"]


class ControlResult(NamedTuple):
    value: object
    deltas: list[RequestOutput]
    """Final outputs of the requests the call ended (mode "abort")."""


def check_pause_mode(mode: object) -> PauseMode:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_sleep_level(level: object) -> int:
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")
    return int(str(level))


def check_wake_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags to wake (all when None); ValueError naming an unknown tag."""
    if tags is None:
        return WAKE_TAGS
    if isinstance(tags, str):
        tags = [tags]
    unknown = [tag for tag in tags if tag not in WAKE_TAGS]
    if unknown:
        raise ValueError(f"wake_up tags must be among {list(WAKE_TAGS)}, got {unknown}")
    return tuple(tags)


def rpc_call(
    method: str | Callable[..., Any], args: Sequence[object], kwargs: Mapping[str, object] | None
) -> RpcCall:
    """The call every rank runs: a worker method's name, or a function pickled by value."""
    if isinstance(method, str):
        return RpcCall(method=method, args=tuple(args), kwargs=dict(kwargs or {}))
    if callable(method):
        function = cloudpickle.dumps(method)
        return RpcCall(function=function, args=tuple(args), kwargs=dict(kwargs or {}))
    raise TypeError(f"collective_rpc method must be a name or a callable, got {method!r}")


def drains_first(name: str, args: Sequence[object]) -> bool:
    """Whether the call waits for the requests in the engine to finish (mode "wait")."""
    if name == "sleep":
        return args[1] == "wait"
    return name == "pause_generation" and args[0] == "wait"


def run_control(core: EngineCore, name: str, *args: Any) -> ControlResult:
    """Run control call `name` on `core` between two steps (mode "wait": already drained)."""
    if name not in CONTROL_NAMES:
        raise ValueError(f"unknown engine control call {name!r}")
    state = core.lifecycle
    if name == "sleep":
        return ControlResult(None, sleep(core, *args))
    if name == "pause_generation":
        return ControlResult(None, pause(core, *args))
    if name == "wake_up":
        return ControlResult(wake_up(core, *args), [])
    if name == "resume_generation":
        if state.asleep_tags:
            raise ValueError("the engine's memory is asleep: call wake_up() to resume")
        return ControlResult(wake_up(core, ("scheduling",)), [])
    if name == "reset_prefix_cache":
        return ControlResult(core.scheduler.reset_prefix_cache(), [])
    if name == "collective_rpc":
        call, timeout = args
        if call.method in ENGINE_RPC_METHODS:  # new weights: the engine's version moves on
            return ControlResult(*engine_rpc(core, call))
        return ControlResult(core.executor.collective_rpc("run_rpc", call, timeout_s=timeout), [])
    value = state.is_sleeping if name == "is_sleeping" else state.is_paused
    return ControlResult(value, [])


def pause(core: EngineCore, mode: PauseMode, clear_cache: bool = True) -> list[RequestOutput]:
    """Stop stepping: abort the requests (mode "abort") or keep them; with `clear_cache`, kept
    requests are preempted and the prefix cache is reset."""
    deltas = core.abort(core.output_processor.request_ids()) if mode == "abort" else []
    core.lifecycle.is_paused = True
    deltas += core.finish_in_flight()
    if clear_cache:
        preempt_all(core.scheduler)
        if not core.scheduler.reset_prefix_cache():
            raise RuntimeError("the prefix cache could not be reset: blocks are still in use")
    return deltas


def sleep(core: EngineCore, level: int, mode: PauseMode) -> list[RequestOutput]:
    """Pause (`mode`); at level 1 or 2 the ranks release their KV pool and weights too."""
    state = core.lifecycle
    if state.asleep_tags and level >= 1:
        raise ValueError("the engine is asleep already: wake_up() first")
    deltas = pause(core, mode, clear_cache=level >= 1)
    if level >= 1:
        core.executor.collective_rpc("sleep", level)
        state.asleep_tags = MEMORY_TAGS
        state.sleep_level = level
    return deltas


def wake_up(core: EngineCore, tags: tuple[str, ...] = WAKE_TAGS) -> bool:
    """Restore the ranks' memory of `tags`; steps resume once nothing is asleep (True then)."""
    state = core.lifecycle
    waking = tuple(tag for tag in tags if tag in state.asleep_tags)
    if waking:
        core.executor.collective_rpc("wake_up", waking)
        state.asleep_tags = tuple(tag for tag in state.asleep_tags if tag not in waking)
    if state.asleep_tags:
        return False
    state.is_paused = False
    state.sleep_level = 0
    return True

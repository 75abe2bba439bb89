"""vLLM's control calls (sleep, wake, pause, prefix-cache reset, collective RPC) on every engine
surface: `LLM`, the clients and the asyncio engine share these signatures, defaults and checks,
and each sends the checked call on by its own `control(name, *args)` (the engine runs it with
`cluster.engine.lifecycle.run_control`).

Where ours differs from vLLM 0.33:
- mode "wait" works on the offline `LLM` too (the engine runs the requests in it to their end
  first; their outputs wait in their streams), and new requests wait at the engine's door until
  it resumes instead of queueing inside it; an offline `LLM` paused refuses new requests (one
  line) rather than blocking forever;
- `resume_generation` of an engine whose memory is asleep is an error (wake it instead);
- `collective_rpc`'s `timeout` bounds ranks in their own processes (Ray, mp), not an in-process
  worker, and exceeding it is the error `worker_step_timeout_s` gives a hung rank.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from cluster.engine.lifecycle import (
    PauseMode,
    check_pause_mode,
    check_sleep_level,
    check_wake_tags,
    rpc_call,
)


class EngineControls:
    """The blocking control calls; a subclass says how a call reaches its engine (`control`)."""

    control: Callable[..., Any]
    """`control(name, *args)`: how a call reaches the engine (each subclass defines it)."""

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Level 0: pause scheduling; 1: also move the weights to host memory and free the KV
        pool (with recurrent and drafter state); 2: free the weights too (read again at wake
        unless new weights are loaded). `mode`: what happens to the requests in the engine."""
        self.control("sleep", check_sleep_level(level), check_pause_mode(mode))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore `tags` ("weights", "kv_cache", "scheduling"; all when None)."""
        self.control("wake_up", check_wake_tags(tags))

    def is_sleeping(self) -> bool:
        """Whether the engine is paused or any of its memory is asleep (as vLLM's)."""
        return bool(self.control("is_sleeping"))

    def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        """Stop stepping; `clear_cache` resets the prefix cache (kept requests recompute)."""
        self.control("pause_generation", check_pause_mode(mode), bool(clear_cache))

    def resume_generation(self) -> None:
        self.control("resume_generation")

    def is_paused(self) -> bool:
        return bool(self.control("is_paused"))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (device pool and offload tier); False while requests
        hold blocks (as vLLM's without `reset_running_requests`)."""
        return bool(self.control("reset_prefix_cache"))

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> list[Any]:
        """Run a worker method (by name) or `method(worker, *args, **kwargs)` on every rank;
        the results in rank order. An unknown name is a one-line ValueError."""
        result: list[Any] = self.control("collective_rpc", rpc_call(method, args, kwargs), timeout)
        return result


class AsyncEngineControls:
    """The asyncio control calls (same meaning as `EngineControls`')."""

    control: Callable[..., Awaitable[Any]]
    """`await control(name, *args)`: how a call reaches the engine (each subclass defines it)."""

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        await self.control("sleep", check_sleep_level(level), check_pause_mode(mode))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.control("wake_up", check_wake_tags(tags))

    async def is_sleeping(self) -> bool:
        return bool(await self.control("is_sleeping"))

    async def pause_generation(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        await self.control("pause_generation", check_pause_mode(mode), bool(clear_cache))

    async def resume_generation(self) -> None:
        await self.control("resume_generation")

    async def is_paused(self) -> bool:
        return bool(await self.control("is_paused"))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.control("reset_prefix_cache"))

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: Sequence[object] = (),
        kwargs: Mapping[str, object] | None = None,
    ) -> list[Any]:
        call = rpc_call(method, args, kwargs)
        result: list[Any] = await self.control("collective_rpc", call, timeout)
        return result

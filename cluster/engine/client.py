"""`EngineClient`: the one interface callers use to reach an engine, sync and async.

Implementations: `InProcessEngineClient` (the engine steps in the caller's thread as its
streams are read), `AsyncEngine` (an asyncio step loop; used inside the Ray engine actor and the
Serve replica) and `RayEngineClient` (a handle on the engine actor). Each `add_request` returns
the request's stream of `RequestOutput` deltas, ending with a finished one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.engine.outputs import OutputAccumulator, RequestOutput
from cluster.engine.request import EngineRequest
from scheduler.stats import SchedulerStats


@dataclass(frozen=True)
class EngineInfo:
    """What a caller needs to know about the engine's model to build requests."""

    model_path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tensor_parallel_size: int
    dtype: str = "float32"
    """The model's dtype as the engine resolved it (`bfloat16`, `float32`, ...)."""


class EngineClient(Protocol):
    """A blocking engine client."""

    def add_request(self, request: EngineRequest) -> Iterator[RequestOutput]:
        """Queue `request` (ValueError at once if it can never run); its stream of deltas."""
        ...

    def abort(self, request_id: str) -> None: ...

    def check_health(self) -> None:
        """Raise RuntimeError when the engine or one of its workers is dead or stuck."""
        ...

    def get_stats(self) -> SchedulerStats: ...

    def get_info(self) -> EngineInfo: ...

    def get_tokenizer(self) -> Any: ...

    def weight_call(self, name: str, *args: object) -> Any:
        """A weight-transfer call (`cluster.engine.weight_calls`)."""
        ...

    def control(self, name: str, *args: object) -> Any:
        """A control call: sleep, wake_up, pause, collective_rpc (`cluster.engine.controls`)."""
        ...

    def shutdown(self) -> None: ...


class AsyncEngineClient(Protocol):
    """An asyncio engine client."""

    async def add_request(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Queue `request` (ValueError at once if it can never run); its stream of deltas."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None: ...

    async def get_stats(self) -> SchedulerStats: ...

    async def get_info(self) -> EngineInfo: ...

    async def get_tokenizer(self) -> Any: ...

    async def shutdown(self) -> None: ...


def generate(client: EngineClient, request: EngineRequest) -> RequestOutput:
    """Run `request` to the end; its cumulative output."""
    return collect(client.add_request(request))


def collect(stream: Iterator[RequestOutput]) -> RequestOutput:
    """Read a stream to its end; the cumulative output."""
    accumulator = OutputAccumulator()
    for delta in stream:
        accumulator.add(delta)
    assert accumulator.result is not None, "a stream ends with a finished output"
    return accumulator.result


async def agenerate(client: AsyncEngineClient, request: EngineRequest) -> RequestOutput:
    """Async `generate`: run `request` to the end; its cumulative output."""
    accumulator = OutputAccumulator()
    async for delta in await client.add_request(request):
        accumulator.add(delta)
    assert accumulator.result is not None, "a stream ends with a finished output"
    return accumulator.result


def engine_info(core: Any) -> EngineInfo:
    """The `EngineInfo` of an `EngineCore`."""
    model = core.model_config
    return EngineInfo(
        model_path=model.model_path,
        architecture=model.architecture,
        vocab_size=model.vocab_size,
        max_model_len=model.max_model_len,
        eos_token_ids=model.eos_token_ids,
        tensor_parallel_size=core.executor.configs.tensor_parallel_size,
        dtype=str(model.dtype).removeprefix("torch."),
    )

"""A failed step (no Ray), on every front over the same core: the requests in flight end with
EngineDeadError, the prefix cache is reset, the workers restart and the next request gets the
same tokens; the restart never holds adds or aborts up; an engine that cannot recover (workers
that do not restart, a prefix cache that cannot be reset) is dead: it refuses work with
EngineDeadError and fails its health check, and the Serve replica answers 503.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from cluster.config.engine_args import EngineArgs
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.client import agenerate, generate
from cluster.engine.configs import engine_configs
from cluster.engine.core import build_engine_core
from cluster.engine.errors import EngineDeadError
from cluster.engine.executor.uniproc import InProcessExecutor
from cluster.engine.local import InProcessEngineClient
from cluster.engine.request import EngineRequest
from cluster.openai_api.protocol import CompletionRequest, ErrorResponse
from cluster.serve.llm_server import LLMServer
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import SamplingParams
from tests.helpers.serve_app import llm_config, save_tiny_served_model

PROMPT = tuple(range(1, 18))
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def args(tmp_path_factory: pytest.TempPathFactory) -> EngineArgs:
    path = save_tiny_served_model(tmp_path_factory.mktemp("tiny"))
    return EngineArgs(
        model=str(path), block_size=4, kv_cache_memory_bytes=1 << 20,
        distributed_executor_backend="uni",
    )  # fmt: skip


class FailingOnceExecutor(InProcessExecutor):
    """The in-process executor, whose step raises once when armed (a dead worker)."""

    is_armed = False
    num_restarts = 0
    restart_s = 0.0
    """How long a restart takes."""
    restart_error: Exception | None = None
    """What a restart raises (workers that cannot be restarted)."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.is_armed:
            self.is_armed = False
            raise RuntimeError("tensor-parallel rank 0 died")
        return super().execute(scheduler_output)

    def restart(self) -> bool:
        self.num_restarts += 1
        time.sleep(self.restart_s)
        if self.restart_error is not None:
            raise self.restart_error
        return False


def test_failed_step_fails_in_flight_requests_and_the_engine_recovers(args: EngineArgs) -> None:
    executor = FailingOnceExecutor(engine_configs(args))
    engine = AsyncEngine(build_engine_core(args, executor))

    async def run() -> None:
        before = await agenerate(engine, EngineRequest("before", PROMPT, PARAMS))
        assert (await engine.get_stats()).prefix_cache_hit_tokens == 0
        executor.is_armed = True
        in_flight = [agenerate(engine, EngineRequest(rid, PROMPT, PARAMS)) for rid in "ab"]
        errors = await asyncio.gather(*in_flight, return_exceptions=True)
        assert all(isinstance(error, EngineDeadError) for error in errors), errors
        assert all("rank 0 died" in str(error) for error in errors)
        stats = await engine.get_stats()
        assert stats.kv_cache_usage == 0.0
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        after = await agenerate(engine, EngineRequest("after", PROMPT, PARAMS))
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        assert after.num_cached_tokens == 0  # the cache was reset: nothing could be reused
        await engine.check_health()
        await engine.shutdown()

    asyncio.run(run())
    assert executor.num_restarts == 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_in_process_client_recovers_the_same_way(args: EngineArgs, async_scheduling: bool) -> None:
    """With async scheduling, the step submitted behind the failed one is discarded too."""
    args = args.model_copy(update={"async_scheduling": async_scheduling})
    executor = FailingOnceExecutor(engine_configs(args))
    client = InProcessEngineClient(build_engine_core(args, executor))
    before = generate(client, EngineRequest("before", PROMPT, PARAMS))
    executor.is_armed = True
    streams = [client.add_request(EngineRequest(rid, PROMPT, PARAMS)) for rid in "ab"]
    for stream in streams:
        with pytest.raises(EngineDeadError, match="rank 0 died"):
            list(stream)
    assert client.get_stats().kv_cache_usage == 0.0
    after = generate(client, EngineRequest("after", PROMPT, PARAMS))
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert executor.num_restarts == 1
    client.check_health()
    client.shutdown()


def test_adds_and_aborts_go_on_while_the_workers_restart(args: EngineArgs) -> None:
    executor = FailingOnceExecutor(engine_configs(args))
    executor.restart_s = 3.0
    engine = AsyncEngine(build_engine_core(args, executor))

    async def run() -> None:
        executor.is_armed = True
        with pytest.raises(EngineDeadError):
            await agenerate(engine, EngineRequest("failing", PROMPT, PARAMS))
        assert engine.is_restarting
        started = time.monotonic()
        stream = await engine.add_request(EngineRequest("during", PROMPT, PARAMS))
        await engine.abort("unknown")
        await engine.check_health()  # a restart under way is no reason to replace the replica
        assert time.monotonic() - started < 1.0
        deltas = [delta async for delta in stream]  # runs once the workers are back
        assert deltas[-1].finished
        assert not engine.is_restarting
        await engine.shutdown()

    asyncio.run(run())


def test_workers_that_cannot_restart_leave_the_engine_dead(args: EngineArgs) -> None:
    executor = FailingOnceExecutor(engine_configs(args))
    executor.restart_s = 1.0
    executor.restart_error = RuntimeError("no node has room for the new rank")
    engine = AsyncEngine(build_engine_core(args, executor))

    async def run() -> None:
        executor.is_armed = True
        with pytest.raises(EngineDeadError):
            await agenerate(engine, EngineRequest("failing", PROMPT, PARAMS))
        waiting = agenerate(engine, EngineRequest("during", PROMPT, PARAMS))
        with pytest.raises(EngineDeadError, match="workers could not be restarted: no node"):
            await waiting  # added while the restart ran: ends when it fails
        with pytest.raises(EngineDeadError, match="the engine is dead"):
            await engine.add_request(EngineRequest("after", PROMPT, PARAMS))
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        assert (await engine.get_stats()).kv_cache_usage == 0.0
        await engine.shutdown()

    asyncio.run(run())


def test_failed_prefix_cache_reset_marks_the_engine_dead(args: EngineArgs) -> None:
    executor = FailingOnceExecutor(engine_configs(args))
    client = InProcessEngineClient(build_engine_core(args, executor))
    client.core.scheduler.kv_cache_manager.pool.get_new_blocks(1, 0)  # a block nobody frees
    executor.is_armed = True
    with pytest.raises(EngineDeadError, match="rank 0 died"):
        generate(client, EngineRequest("failing", PROMPT, PARAMS))
    message = "the engine is dead: its prefix cache could not be reset"
    with pytest.raises(EngineDeadError, match=message):
        client.add_request(EngineRequest("after", PROMPT, PARAMS))
    with pytest.raises(EngineDeadError, match=message):
        client.check_health()
    assert executor.num_restarts == 0  # a dead engine does not restart its workers
    client.shutdown()


def test_dead_engine_answers_503_and_fails_the_replicas_health_check(args: EngineArgs) -> None:
    assert args.model is not None
    server = LLMServer(
        {
            **llm_config(Path(args.model), distributed_executor_backend="uni"),
            "log_engine_metrics": False,
        }
    )
    core = server.engine.core
    core.scheduler.kv_cache_manager.pool.get_new_blocks(1, 0)
    core.drop_all_requests()  # what a failed step does: the cache cannot be reset

    async def first_item(stream: bool) -> object:
        request = CompletionRequest(model="tiny", prompt="t1 t2", max_tokens=2, stream=stream)
        return await anext(aiter(server.generate(request, f"r-{stream}")))

    for stream in (False, True):
        error = asyncio.run(first_item(stream))
        assert isinstance(error, ErrorResponse)
        assert (error.status, error.error.type) == (503, "service_unavailable")
        assert "prefix cache could not be reset" in error.error.message
    with pytest.raises(EngineDeadError):
        asyncio.run(server.check_health())
    core.shutdown()

"""A failed step (no Ray): every request in flight ends with EngineDeadError, the prefix cache is
reset, and the asyncio engine serves the next request with the same tokens as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

from cluster.engine.async_engine import AsyncEngine, EngineDeadError
from cluster.engine.client import agenerate
from cluster.engine.core import build_engine_core
from cluster.engine.executor.uniproc import InProcessExecutor
from cluster.engine.request import EngineRequest
from cluster.engine_args import EngineArgs
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from scheduler.request import SamplingParams
from tests.helpers.tiny_models import save_tiny_model

PROMPT = tuple(range(1, 18))
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class FailingOnceExecutor(InProcessExecutor):
    """The in-process executor, whose step raises once when armed (a dead worker)."""

    is_armed = False
    num_restarts = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.is_armed:
            self.is_armed = False
            raise RuntimeError("tensor-parallel rank 0 died")
        return super().execute(scheduler_output)

    def restart(self) -> bool:
        self.num_restarts += 1
        return False


def test_failed_step_fails_in_flight_requests_and_the_engine_recovers(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)
    args = EngineArgs(
        model=str(tmp_path),
        block_size=4,
        kv_cache_memory_bytes=1 << 20,
        distributed_executor_backend="uni",
    )
    executor = FailingOnceExecutor(args.to_configs())
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

"""Stream coalescing in `AsyncEngine`: a reader that falls behind gets the deltas queued
meanwhile as one merged delta, carrying exactly the text, tokens and logprobs of the deltas
read one by one; a reader that keeps up gets one delta per token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.config.engine_args import EngineArgs
from cluster.engine.async_engine import AsyncEngine, coalesce_queued
from cluster.engine.core import build_engine_core
from cluster.engine.errors import EngineDeadError
from cluster.engine.outputs import CompletionOutput, OutputAccumulator, RequestOutput
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams
from tests.helpers.serve_app import save_tiny_served_model

ARGS = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 1 << 22, "max_model_len": 64}
NO_HIT = {"enable_prefix_caching": False}  # both reads compute the prompt alike
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
PROMPT = (5, 9, 17, 33, 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_served_model(tmp_path_factory.mktemp("words"))


def _delta(text: str, finished: bool = False) -> RequestOutput:
    part = CompletionOutput(0, text, [len(text)], finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], [part], finished)


def test_queued_deltas_merge_up_to_the_error_behind_them() -> None:
    async def run() -> tuple[RequestOutput, object, int]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        error = EngineDeadError("gone")
        for item in (_delta(" b"), _delta(" c"), error, _delta(" late")):
            queue.put_nowait(item)
        merged, held = coalesce_queued(_delta("a"), queue)
        return merged, held, queue.qsize()

    merged, held, left = asyncio.run(run())
    assert merged.outputs[0].text == "a b c"
    assert merged.outputs[0].token_ids == [1, 2, 2]
    assert isinstance(held, EngineDeadError)
    assert left == 1  # nothing past the error was taken


def test_a_finished_delta_ends_the_merge() -> None:
    async def run() -> tuple[RequestOutput, int]:
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        queue.put_nowait(_delta(" end", finished=True))
        queue.put_nowait(_delta(" other request's turn"))
        merged, _ = coalesce_queued(_delta("x"), queue)
        return merged, queue.qsize()

    merged, left = asyncio.run(run())
    assert merged.finished
    assert merged.outputs[0].text == "x end"
    assert left == 1


def test_a_slow_reader_gets_fewer_items_with_the_same_text(model_dir: Path) -> None:
    async def read(engine: AsyncEngine, request_id: str, lag_s: float) -> tuple[int, object]:
        stream = await engine.add_request(EngineRequest(request_id, PROMPT, PARAMS))
        accumulator, items = OutputAccumulator(), 0
        async for delta in stream:
            items += 1
            accumulator.add(delta)
            await asyncio.sleep(lag_s)  # a reader behind the engine lets deltas queue up
        result = accumulator.result
        assert result is not None
        part = result.outputs[0]
        return items, (part.text, part.token_ids, part.logprobs, part.finish_reason)

    async def run() -> tuple[tuple[int, object], tuple[int, object]]:
        engine = AsyncEngine(build_engine_core(EngineArgs(model=str(model_dir), **ARGS, **NO_HIT)))
        try:
            prompt_only = await read(engine, "prompt", 0.0)
            lagging = await read(engine, "lagging", 0.2)
        finally:
            await engine.shutdown()
        return prompt_only, lagging

    (prompt_items, prompt_output), (lag_items, lag_output) = asyncio.run(run())
    assert lag_output == prompt_output
    assert prompt_items > lag_items
    assert lag_items >= 1

"""vLLM's control calls on the offline engine and the asyncio engine (tiny Llama, in-process):
pause modes, collective RPC by name and by function, and bad calls refused in one line."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.client import agenerate
from cluster.engine.request import EngineRequest
from tests.helpers.tiny_models import save_tiny_model

PARAMS = SamplingParams(temperature=0, max_tokens=6)
PROMPT = [3, 14, 15, 92, 65]
ARGS = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 1 << 20, "max_model_len": 64}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    engine = LLM(str(path), **ARGS)
    yield engine
    engine.shutdown()


def _one_line_error(error_type: type[Exception], call: object, match: str) -> None:
    with pytest.raises(error_type, match=match) as info:
        call()  # type: ignore[operator]
    assert "\n" not in str(info.value)


def test_bad_calls_are_refused_in_one_line(llm: LLM) -> None:
    _one_line_error(ValueError, lambda: llm.sleep(level=3), "sleep level must be 0, 1 or 2")
    _one_line_error(ValueError, lambda: llm.sleep(mode="later"), "mode must be one of")
    _one_line_error(ValueError, lambda: llm.wake_up(tags=["gpu"]), "wake_up tags must be")
    _one_line_error(ValueError, lambda: llm.collective_rpc("no_such_method"), "no method")
    _one_line_error(TypeError, lambda: llm.collective_rpc(42), "name or a callable")  # type: ignore[arg-type]
    assert not llm.is_sleeping()


def test_collective_rpc_runs_a_method_or_a_function_on_every_rank(llm: LLM) -> None:
    assert llm.collective_rpc("cpu_threads") == [llm.collective_rpc(lambda w: w.cpu_threads())[0]]
    assert llm.collective_rpc(lambda w, x, y=0: (w.rank, x + y), args=(2,), kwargs={"y": 3}) == [
        (0, 5)
    ]


def test_pause_abort_ends_requests_and_resume_serves_again(llm: LLM) -> None:
    (expected,) = llm.generate([PROMPT], PARAMS)
    stream = llm.stream(PROMPT, PARAMS)
    next(stream)
    llm.pause_generation(mode="abort")
    assert llm.is_paused()
    assert llm.is_sleeping()
    *_, last = stream
    assert last.outputs[0].finish_reason == "abort"
    llm.resume_generation()
    assert not llm.is_paused()
    (again,) = llm.generate([PROMPT], PARAMS)
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids


def test_level_zero_sleep_wakes_with_scheduling_only(llm: LLM) -> None:
    llm.sleep(level=0, mode="wait")
    assert llm.is_sleeping()
    llm.wake_up(tags=["scheduling"])
    assert not llm.is_sleeping()


def test_wait_mode_lets_requests_finish_and_holds_new_ones(llm: LLM) -> None:
    """Asyncio engine: `pause_generation("wait")` returns once the running request finished
    whole; a request added meanwhile waits until the resume, then runs."""
    (expected,) = llm.generate([PROMPT], PARAMS)

    async def scenario() -> tuple[list[int], list[int], bool]:
        engine = AsyncEngine(llm.client.core)  # type: ignore[attr-defined]
        first = asyncio.ensure_future(agenerate(engine, _request("first")))
        await asyncio.sleep(0.01)
        await engine.pause_generation(mode="wait")
        assert first.done()
        held = asyncio.ensure_future(agenerate(engine, _request("held")))
        await asyncio.sleep(0.05)
        waiting = not held.done()
        await engine.resume_generation()
        return (await first).outputs[0].token_ids, (await held).outputs[0].token_ids, waiting

    first, held, waited = asyncio.run(scenario())
    assert waited
    assert first == held == expected.outputs[0].token_ids


def _request(request_id: str) -> EngineRequest:
    return EngineRequest(
        request_id=request_id, prompt_token_ids=tuple(PROMPT), sampling_params=PARAMS
    )

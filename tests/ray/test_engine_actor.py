"""The engine actor through `LLM(address=...)`: streaming, abort, cancellation, worker faults.

One engine (a tiny Llama with a word-level tokenizer, one rank, a short step timeout) serves the
whole module; the fault tests check that in-flight requests fail within seconds and that the
restarted workers serve the next request with the same tokens. The engine actor's own death
reaches callers as one line of `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cluster.engine.client import collect
from cluster.engine.errors import EngineDeadError
from cluster.engine.outputs import OutputAccumulator
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from cluster.llm import LLM
from scheduler.request import SamplingParams
from tests.helpers.ray_state import (
    live_engine_actors,
    live_placement_groups,
    settled_engine_actors,
)
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.word_tokenizer import save_word_tokenizer

pytestmark = pytest.mark.ray

STEP_TIMEOUT_S = 6.0
FAULT_DETECTION_S = 15.0
ENGINE_KWARGS = {
    "dtype": "float32",
    "block_size": 4,
    "kv_cache_memory_bytes": 2 << 20,
    "max_model_len": 128,
}
PROMPTS = ["t5 t17 t33 t2 t9", "t100 t3 t3 t42 t8 t1 t77 t61 t200 t12"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama-tok")
    model = save_tiny_model("llama", path)
    save_word_tokenizer(path, model.config.vocab_size)
    return path


@pytest.fixture(scope="module")
def llm(ray_cluster: None, model_dir: Path) -> Iterator[LLM]:
    actors_before, groups_before = live_engine_actors(), live_placement_groups()
    engine = LLM(
        str(model_dir), address="auto", worker_step_timeout_s=STEP_TIMEOUT_S, **ENGINE_KWARGS
    )
    yield engine
    engine.shutdown()
    assert settled_engine_actors(actors_before) == actors_before, "shutdown left actors behind"
    assert live_placement_groups() == groups_before, "shutdown left a placement group behind"


@pytest.fixture
def client(llm: LLM) -> RayEngineClient:
    assert isinstance(llm.client, RayEngineClient)
    return llm.client


def _long_request(request_id: str) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    return EngineRequest(request_id, tuple(range(1, 21)), params)


def _wait_for_usage(client: RayEngineClient, usage: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get_stats().kv_cache_usage != usage:
        assert time.monotonic() < deadline, f"KV usage stayed {client.get_stats().kv_cache_usage}"
        time.sleep(0.05)


def test_llm_with_address_matches_in_process(llm: LLM, model_dir: Path) -> None:
    in_process = LLM(str(model_dir), distributed_executor_backend="uni", **ENGINE_KWARGS)
    try:
        expected = in_process.generate(PROMPTS, GREEDY)
    finally:
        in_process.shutdown()
    results = llm.generate(PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in results] == [e.outputs[0].token_ids for e in expected]
    assert [r.outputs[0].text for r in results] == [e.outputs[0].text for e in expected]


def test_engine_actor_streams_deltas(client: RayEngineClient, llm: LLM) -> None:
    prompt_ids = tuple(llm.tokenizer(PROMPTS[1]).input_ids)
    deltas = list(client.add_request(EngineRequest("stream", prompt_ids, GREEDY)))
    assert len(deltas) >= 3
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    accumulator = OutputAccumulator()
    for delta in deltas:
        accumulator.add(delta)
    final = accumulator.result
    assert final is not None
    assert len(final.outputs[0].token_ids) == GREEDY.max_tokens
    streamed_text = "".join(d.outputs[0].text for d in deltas)
    assert streamed_text == final.outputs[0].text
    whole = llm.tokenizer.decode(list(prompt_ids) + final.outputs[0].token_ids)
    assert streamed_text == whole[len(llm.tokenizer.decode(list(prompt_ids))) :]


def test_a_caller_that_falls_behind_gets_merged_deltas(client: RayEngineClient, llm: LLM) -> None:
    """The actor's stream waits for its caller, so the deltas of the steps meanwhile arrive
    merged: fewer items, the same tokens and text as a stream read at once."""
    prompt_ids = tuple(llm.tokenizer(PROMPTS[0]).input_ids)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = list(client.add_request(EngineRequest("prompt-reader", prompt_ids, params)))
    lagging = client.add_request(EngineRequest("lagging-reader", prompt_ids, params))
    deadline = time.monotonic() + 30
    while (stats := client.get_stats()).num_running_reqs or stats.num_waiting_reqs:
        assert time.monotonic() < deadline, "the request never finished"
        time.sleep(0.05)  # it runs to its end while nobody reads its stream
    late = list(lagging)
    assert len(late) < len(prompt)
    merged = [OutputAccumulator() for _ in range(2)]
    for accumulator, deltas in zip(merged, (prompt, late), strict=True):
        for delta in deltas:
            accumulator.add(delta)
    first, second = (accumulator.result for accumulator in merged)
    assert first is not None
    assert second is not None
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.outputs[0].text == first.outputs[0].text
    assert len(second.outputs[0].token_ids) == 40


def test_abort_frees_the_requests_blocks(client: RayEngineClient) -> None:
    usage_before = client.get_stats().kv_cache_usage
    stream = client.add_request(_long_request("to-abort"))
    next(stream)
    assert client.get_stats().kv_cache_usage > usage_before
    client.abort("to-abort")
    rest = list(stream)
    assert rest
    assert rest[-1].finish_reason == "abort"
    _wait_for_usage(client, usage_before)


def test_closing_a_stream_aborts_the_request(client: RayEngineClient) -> None:
    usage_before = client.get_stats().kv_cache_usage
    stream = client.add_request(_long_request("to-close"))
    next(stream)
    stream.close()  # type: ignore[attr-defined]
    _wait_for_usage(client, usage_before)


def test_cancelling_an_async_stream_aborts_the_request(client: RayEngineClient) -> None:
    usage_before = client.get_stats().kv_cache_usage
    async_client = client.async_client()

    async def consume(first_delta: asyncio.Event) -> None:
        async for _ in await async_client.add_request(_long_request("to-cancel")):
            first_delta.set()

    async def main() -> None:
        first_delta = asyncio.Event()
        task = asyncio.create_task(consume(first_delta))
        await asyncio.wait_for(first_delta.wait(), timeout=30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_for_usage(client, usage_before)


def _read_until_error(streams: list[Iterator[object]]) -> list[BaseException]:
    errors = []
    for stream in streams:
        with pytest.raises(RuntimeError) as error:
            for _ in stream:
                pass
        errors.append(error.value)
    return errors


def _check_recovered(client: RayEngineClient, llm: LLM, old_workers: list[str]) -> None:
    prompt_ids = tuple(llm.tokenizer(PROMPTS[0]).input_ids)
    expected = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    result = collect(client.add_request(EngineRequest("after", prompt_ids, GREEDY)))
    assert result.outputs[0].token_ids == expected
    new_workers = ray.get(client.actor.worker_actor_names.remote())
    assert len(new_workers) == len(old_workers)
    assert not set(new_workers) & set(old_workers)
    assert client.get_stats().kv_cache_usage == 0.0
    client.check_health()


def test_killed_worker_fails_in_flight_requests_then_recovers(
    client: RayEngineClient, llm: LLM
) -> None:
    workers = ray.get(client.actor.worker_actor_names.remote())
    streams = [client.add_request(_long_request(f"kill-{i}")) for i in range(3)]
    for stream in streams:
        next(stream)
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(workers[0]), no_restart=True)
    errors = _read_until_error(streams)
    assert time.monotonic() - killed_at < FAULT_DETECTION_S
    assert all("rank 0 died" in str(e) for e in errors), errors
    _check_recovered(client, llm, workers)


def test_hung_worker_is_detected_by_the_step_timeout(client: RayEngineClient, llm: LLM) -> None:
    workers = ray.get(client.actor.worker_actor_names.remote())
    ray.get(client.actor.delay_steps.remote(600.0))
    started = time.monotonic()
    stream = client.add_request(_long_request("hang"))
    errors = _read_until_error([stream])
    assert time.monotonic() - started < STEP_TIMEOUT_S + FAULT_DETECTION_S
    assert "worker_step_timeout_s" in str(errors[0])
    _check_recovered(client, llm, workers)


def test_killed_engine_actor_is_one_line_engine_dead_error(
    ray_cluster: None, model_dir: Path
) -> None:
    actors_before = live_engine_actors()
    llm = LLM(str(model_dir), address="auto", **ENGINE_KWARGS)
    try:
        assert isinstance(llm.client, RayEngineClient)
        stream = llm.client.add_request(_long_request("orphan"))
        next(stream)
        killed_at = time.monotonic()
        ray.kill(llm.client.actor, no_restart=True)
        with pytest.raises(EngineDeadError) as in_flight:
            list(stream)
        with pytest.raises(EngineDeadError) as later:
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - killed_at < FAULT_DETECTION_S
    finally:
        llm.shutdown()
    for error in (in_flight.value, later.value):
        assert str(error).startswith("the engine actor is gone"), error
        assert "\n" not in str(error)
    left = settled_engine_actors(actors_before)
    assert left == actors_before, f"its worker actors outlived it: {left - actors_before}"

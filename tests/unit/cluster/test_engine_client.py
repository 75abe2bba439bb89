"""The engine boundary: `EngineRequest` in, streams of vLLM-shaped deltas out, sync and async.

The in-process client and the asyncio engine must give exactly what `LLM.generate` gives
(the same engine core underneath), stream each request in several deltas that add up to the
final output, fan `n` samples out over the prefix cache, time every request, and free a
request's blocks when its stream is closed early.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.config.engine_args import EngineArgs
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.client import collect, generate
from cluster.engine.core import build_engine_core
from cluster.engine.local import InProcessEngineClient
from cluster.engine.outputs import OutputAccumulator
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams
from tests.helpers.tiny_models import save_tiny_model

PROMPT = tuple((5 * i + 1) % 256 for i in range(13))
ARGS = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 1 << 22, "max_model_len": 64}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def client(model_dir: Path):
    engine = InProcessEngineClient.from_engine_args(EngineArgs(model=str(model_dir), **ARGS))
    yield engine
    engine.shutdown()


def _request(request_id: str, **params: object) -> EngineRequest:
    return EngineRequest(request_id, PROMPT, SamplingParams(**params))  # type: ignore[arg-type]


def test_stream_is_deltas_that_add_up_to_the_generated_output(client) -> None:
    deltas = list(client.add_request(_request("a", temperature=0, max_tokens=6)))
    assert len(deltas) == 6  # one delta per decoded token
    assert [d.finished for d in deltas] == [False] * 5 + [True]
    assert all(len(d.outputs) == 1 and len(d.outputs[0].token_ids) == 1 for d in deltas)
    total = generate(client, _request("b", temperature=0, max_tokens=6))
    assert total.outputs[0].token_ids == [d.outputs[0].token_ids[0] for d in deltas]
    assert total.outputs[0].finish_reason == "length"
    assert total.prompt_token_ids == list(PROMPT)


def test_every_request_is_timed(client) -> None:
    result = generate(client, _request("timed", temperature=0, max_tokens=5))
    metrics = result.metrics
    assert metrics is not None
    assert metrics.queue_time is not None
    assert metrics.queue_time >= 0
    assert 0 <= metrics.time_to_first_token <= metrics.e2e_latency  # type: ignore[operator]
    assert len(metrics.inter_token_latencies) == 4
    assert all(latency >= 0 for latency in metrics.inter_token_latencies)
    assert metrics.first_token_time + sum(metrics.inter_token_latencies) == pytest.approx(
        metrics.last_token_time
    )


def test_n_samples_are_seeded_distinct_and_share_the_prompt_blocks(client) -> None:
    client.core.scheduler.reset_prefix_cache()
    params = {"temperature": 1.0, "max_tokens": 8, "seed": 7}
    result = generate(client, _request("n3", n=3, **params))
    assert [o.index for o in result.outputs] == [0, 1, 2]
    samples = [tuple(o.token_ids) for o in result.outputs]
    assert len(set(samples)) == 3
    # Sample i is what a single request seeded seed + i draws.
    for index, sample in enumerate(samples):
        alone = generate(client, _request(f"alone{index}", max_tokens=8, seed=7 + index))
        assert tuple(alone.outputs[0].token_ids) == sample
    # The samples after the first read the prompt's full blocks from the prefix cache.
    assert result.num_cached_tokens == 12


def test_closing_a_stream_early_aborts_the_request_and_frees_its_blocks(client) -> None:
    before = client.get_stats().kv_cache_usage
    stream = client.add_request(_request("early", temperature=0, max_tokens=40))
    next(stream)
    assert client.get_stats().kv_cache_usage > before
    stream.close()
    assert client.get_stats().kv_cache_usage == before
    assert not client.has_unfinished_requests()


def test_a_request_that_can_never_run_is_refused_before_it_is_queued(client) -> None:
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        client.add_request(EngineRequest("bad", (1, 999), SamplingParams()))
    with pytest.raises(ValueError, match=r"max_model_len|longer|exceed"):
        client.add_request(EngineRequest("long", tuple(range(1, 70)), SamplingParams()))
    assert not client.has_unfinished_requests()


def test_async_engine_streams_concurrent_requests_like_the_sync_client(model_dir, client) -> None:
    expected = [
        generate(client, _request(f"s{i}", temperature=0, max_tokens=5 + i)).outputs[0].token_ids
        for i in range(3)
    ]

    async def run() -> list[list[int]]:
        engine = AsyncEngine(build_engine_core(EngineArgs(model=str(model_dir), **ARGS)))

        async def one(i: int) -> list[int]:
            accumulator = OutputAccumulator()
            async for delta in await engine.add_request(
                _request(f"c{i}", temperature=0, max_tokens=5 + i)
            ):
                accumulator.add(delta)
            assert accumulator.result is not None
            assert accumulator.result.finished
            return accumulator.result.outputs[0].token_ids

        try:
            results = await asyncio.gather(*(one(i) for i in range(3)))
            stats = await engine.get_stats()
            assert stats.num_running_reqs == 0
            # Cancelling a consumer mid-stream aborts its request.
            stream = await engine.add_request(_request("cancel", temperature=0, max_tokens=40))
            await stream.__anext__()
            await stream.aclose()
            assert not engine.core.has_unfinished_requests()
            assert (await engine.get_stats()).kv_cache_usage == 0
        finally:
            await engine.shutdown()
        return list(results)

    assert asyncio.run(run()) == expected


def test_collect_reads_a_stream_to_its_end(client) -> None:
    stream = client.add_request(_request("collect", temperature=0, max_tokens=3))
    assert collect(stream).outputs[0].finish_reason == "length"

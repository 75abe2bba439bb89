"""Stream batching: the interval a stream holds its tokens, by load (`StreamBatching`), the hold
and flush decisions of one stream on an injected clock (`HeldChunk`), the config key and flag,
an engine whose streams hold tokens under a fixed interval but never the first or the last, and
the Serve replica's default (adaptive) policy driven by many streams at once.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.cli.serve import add_parser, applications
from cluster.config import LLMConfig
from cluster.config.engine_args import EngineArgs
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.core import build_engine_core
from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine.stream_batching import (
    CHUNK_CPU_S,
    CHUNK_CPU_SHARE,
    FEW_STREAMS,
    HeldChunk,
    StreamBatching,
)
from cluster.openai_api.protocol import CompletionRequest
from cluster.serve.llm_server import LLMServer
from scheduler.request import SamplingParams
from tests.helpers.serve_app import llm_config, save_tiny_served_model

ARGS = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 1 << 22, "max_model_len": 64}


def _delta(token: int, finished: bool = False) -> RequestOutput:
    part = CompletionOutput(0, f" t{token}", [token], finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], [part], finished)


def test_adaptive_interval_is_zero_for_few_streams_and_caps_the_chunk_rate() -> None:
    adaptive = StreamBatching()
    assert [adaptive.interval_s(n) for n in range(FEW_STREAMS + 1)] == [0.0] * (FEW_STREAMS + 1)
    budget_chunks_per_s = CHUNK_CPU_SHARE / CHUNK_CPU_S
    for streams in (FEW_STREAMS + 1, 16, 64, 256):
        interval = adaptive.interval_s(streams)
        assert interval > 0
        assert streams / interval == pytest.approx(budget_chunks_per_s)  # chunks/s at the cap
    assert adaptive.interval_s(64) > adaptive.interval_s(16)


def test_a_fixed_interval_ignores_the_load() -> None:
    fixed = StreamBatching(50)
    assert {fixed.interval_s(n) for n in (0, 1, 64)} == {0.05}
    assert StreamBatching(0).interval_s(64) == 0.0
    with pytest.raises(ValueError, match="stream_batching_interval_ms"):
        StreamBatching(-1)


def test_held_chunk_sends_the_first_at_once_then_holds_for_the_interval() -> None:
    held = HeldChunk()
    held.add(_delta(1))
    assert held.wait_s(now=10.0, interval_s=0.05) == 0.0  # the first chunk is never held
    assert held.take(now=10.0).outputs[0].token_ids == [1]
    assert held.empty
    held.add(_delta(2))
    assert held.wait_s(now=10.01, interval_s=0.05) == pytest.approx(0.04)
    held.add(_delta(3))
    assert held.wait_s(now=10.03, interval_s=0.05) == pytest.approx(0.02)
    assert held.wait_s(now=10.06, interval_s=0.05) == 0.0  # due
    chunk = held.take(now=10.06)
    assert chunk.outputs[0].token_ids == [2, 3]
    assert chunk.outputs[0].text == " t2 t3"
    held.add(_delta(4))
    assert held.wait_s(now=10.07, interval_s=0.05) == pytest.approx(0.04)  # from the last send
    assert held.wait_s(now=10.07, interval_s=0.0) == 0.0  # no interval under this load


def test_held_chunk_never_holds_the_final_delta() -> None:
    held = HeldChunk()
    held.add(_delta(1))
    held.take(now=0.0)
    held.add(_delta(2))
    held.add(_delta(3, finished=True))
    assert held.wait_s(now=0.001, interval_s=10.0) == 0.0
    chunk = held.take(now=0.001)
    assert chunk.finished
    assert chunk.outputs[0].token_ids == [2, 3]


def test_the_config_key_and_the_serve_flag() -> None:
    source = {"model_loading_config": {"model_id": "m", "model_source": "/m"}}
    assert LLMConfig.model_validate(source).stream_batching_interval_ms is None
    fixed = LLMConfig.model_validate(
        {**source, "experimental_configs": {"stream_batching_interval_ms": 50}}
    )
    assert fixed.stream_batching_interval_ms == 50.0
    for bad in (-5, "soon", True):
        with pytest.raises(ValidationError, match="stream_batching_interval_ms"):
            LLMConfig.model_validate(
                {**source, "experimental_configs": {"stream_batching_interval_ms": bad}}
            )
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "/m", "--stream-batching-interval-ms", "25"])
    config = applications(args)[0][0]["args"]["llm_configs"][0]
    assert LLMConfig.model_validate(config).stream_batching_interval_ms == 25.0
    args = parser.parse_args(["serve", "--config", "x.yaml", "--stream-batching-interval-ms", "5"])
    with pytest.raises(ValueError, match="stream-batching-interval-ms"):
        applications(args)


def test_an_engine_stream_holds_tokens_but_not_the_first_or_the_final(tmp_path: Path) -> None:
    """Under a 30 s interval a 16-token stream is two items: the first token at once, then
    the other 15 with the finish as soon as the request ends (long before the interval)."""
    model_dir = save_tiny_served_model(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    async def read(interval_ms: float) -> tuple[list[int], float]:
        args = EngineArgs(model=str(model_dir), **ARGS)
        engine = AsyncEngine(build_engine_core(args), StreamBatching(interval_ms))
        try:
            start = time.monotonic()
            stream = await engine.add_request(EngineRequest("r", (5, 9, 17), params))
            sizes = [len(delta.outputs[0].token_ids) async for delta in stream]
            return sizes, time.monotonic() - start
        finally:
            await engine.shutdown()

    sizes, elapsed = asyncio.run(read(30_000))
    assert sizes == [1, 15]
    assert elapsed < 20
    unbatched, _ = asyncio.run(read(0))
    assert len(unbatched) > 2
    assert sum(unbatched) == 16


@dataclass(frozen=True)
class Chunk:
    """One streamed chunk as its reader saw it: the engine's step count when it arrived, the
    tokens it carries (one word each) and its finish reason."""

    step: int
    num_tokens: int
    finish_reason: str | None


MANY_STREAMS = 64
"""Enough streams that the adaptive interval spans several engine steps."""


def _max_tokens(index: int) -> int:
    """Lengths from 12 to 24 tokens: most streams finish while others still run."""
    return 12 + index % 13


async def _read_streams(server: LLMServer, num_streams: int) -> list[list[Chunk]]:
    """`num_streams` streamed completions started at once through the replica; each stream's
    chunks, steps counted from the first step of the batch."""
    start = server.engine.num_steps

    async def read(index: int) -> list[Chunk]:
        request = CompletionRequest(
            model="tiny", prompt=f"t{index + 1} t2 t3", max_tokens=_max_tokens(index),
            ignore_eos=True, stream=True, temperature=0,
        )  # fmt: skip
        chunks = []
        async for item in server.generate(request, f"{num_streams}-{index}", as_sse=False):
            (choice,) = item.choices
            step = server.engine.num_steps - start
            chunks.append(Chunk(step, len(choice.text.split()), choice.finish_reason))
        return chunks

    return list(await asyncio.gather(*(read(index) for index in range(num_streams))))


def test_the_replica_adapts_the_interval_to_the_number_of_streams(tmp_path: Path) -> None:
    """The replica's default policy on real streams: with a few streams every token is its own
    chunk; with many (an interval of several steps), chunks carry several tokens, yet each
    stream's first token is a chunk of its own from the first step, and its final chunk leaves
    at the step that finishes it (while other streams keep the engine stepping), not an
    interval later. Steps are the engine's count when the reader gets the chunk."""
    model_dir = save_tiny_served_model(tmp_path)
    config = llm_config(model_dir, distributed_executor_backend="uni", max_model_len=64)
    server = LLMServer({**config, "log_engine_metrics": False})
    assert server.config.stream_batching_interval_ms is None  # adaptive: the default

    async def read_both() -> tuple[list[list[Chunk]], list[list[Chunk]]]:
        return await _read_streams(server, FEW_STREAMS), await _read_streams(server, MANY_STREAMS)

    try:
        few, many = asyncio.run(read_both())
    finally:
        server.engine.core.shutdown()
    for chunks in few:  # one token each (two where the reader fell a step behind)
        assert max(chunk.num_tokens for chunk in chunks) <= 2, chunks
    longest = max(_max_tokens(index) for index in range(MANY_STREAMS))
    middle_sizes = []
    for index, chunks in enumerate(many):
        first, *middle, final = chunks
        assert first.num_tokens == 1
        assert first.step <= 2  # sent from the step that made it (or the next)
        assert sum(chunk.num_tokens for chunk in chunks) == _max_tokens(index)
        assert final.finish_reason == "length"
        if _max_tokens(index) < longest:
            assert final.step <= _max_tokens(index) + 1, chunks  # its last token's step
        middle_sizes += [chunk.num_tokens for chunk in middle]
    # several tokens per chunk on average (one without batching); the interval is in time, so
    # on a loaded machine (slower steps) fewer steps fit in it than on a quiet one
    assert sum(middle_sizes) / len(middle_sizes) >= 2, middle_sizes

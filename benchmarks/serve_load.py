"""The load generator of `bench_serve.py`: streaming completions at a fixed concurrency, against an
HTTP endpoint or an engine client called directly, summarised the same way (TTFT and inter-token
latency p50/p99, output tokens/s).

Tokens are counted from the stream's own token counts (usage for HTTP, delta token IDs for the
engine), so coalesced chunks that carry several tokens count fully; each chunk after the first
gives one inter-token latency sample per token it carries (its gap split evenly), and one
client-seen gap (the time since the previous chunk: what a reader of the stream waits).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx


@dataclass
class Sample:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive chunks, as the client sees them."""
    tokens: int = 0
    chunks: int = 0
    error: str | None = None

    def add_chunk(self, num_tokens: int, start: float, last: float) -> float:
        """Record a chunk of `num_tokens` arriving now (the first sets TTFT; a later one adds
        one latency per token, its gap split evenly); returns now."""
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - start
        else:
            self.itls.extend([(now - last) / num_tokens] * num_tokens)
            self.gaps.append(now - last)
        self.tokens += num_tokens
        self.chunks += 1
        return now


OneRequest = Callable[[int], Awaitable[Sample]]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def prompt_text(index: int, length: int) -> str:
    return " ".join(f"t{(index * 7 + i) % 250 + 1}" for i in range(length))


def _take_sse_line(sample: Sample, line: str, start: float, last: float) -> float:
    """Count one SSE line of a streamed completion into `sample`: tokens from the usage chunk,
    chunk times from text chunks; returns the time of the last chunk counted."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return last
    chunk = json.loads(line[6:])
    if chunk.get("usage") and not chunk["choices"]:
        sample.tokens = chunk["usage"]["completion_tokens"]
        return last
    text = chunk["choices"][0]["text"] if chunk["choices"] else ""
    if not text:
        return last
    return sample.add_chunk(len(text.split()), start, last)  # the word tokenizer: a word a token


async def http_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Sample:
    """One streaming completion; tokens from the usage chunk, chunk times from text chunks."""
    sample = Sample()
    start = last = time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                sample.error = str(response.status_code)
                await response.aread()
                return sample
            async for line in response.aiter_lines():
                last = _take_sse_line(sample, line, start, last)
    except httpx.HTTPError as error:
        sample.error = type(error).__name__
    return sample


async def aiohttp_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sample:
    """`http_stream` on aiohttp, a client that spends a fraction of httpx's CPU per chunk (the
    load generator shares the machine with what it measures)."""
    sample = Sample()
    start = last = time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                sample.error = str(response.status)
                await response.read()
                return sample
            async for raw in response.content:
                last = _take_sse_line(sample, raw.decode().rstrip("\n"), start, last)
    except aiohttp.ClientError as error:
        sample.error = type(error).__name__
    return sample


async def engine_stream(engine: Any, make_request: Callable[[int], Any], index: int) -> Sample:
    """One request on an engine client called directly (the ingress's work included)."""
    sample = Sample()
    start = last = time.perf_counter()
    stream = await engine.add_request(make_request(index))
    async for delta in stream:
        count = sum(len(part.token_ids) for part in delta.outputs)
        if count:
            last = sample.add_chunk(count, start, last)
    return sample


async def sweep_level(one: OneRequest, concurrency: int, requests: int) -> dict[str, Any]:
    """`requests` requests, `concurrency` at a time; the level's summary."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(index)
    samples: list[Sample] = []

    async def worker() -> None:
        while not queue.empty():
            samples.append(await one(queue.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    ttfts = [s.ttft for s in samples if s.ttft is not None]
    itls = [x for s in samples for x in s.itls]
    gaps = [x for s in samples for x in s.gaps]
    chunks = sum(s.chunks for s in samples)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "errors": sum(s.error is not None for s in samples),
        "ttft_p50_ms": 1000 * pct(ttfts, 0.5),
        "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
        "itl_p50_ms": 1000 * pct(itls, 0.5),
        "itl_p99_ms": 1000 * pct(itls, 0.99),
        "chunk_gap_p50_ms": 1000 * pct(gaps, 0.5),
        "chunk_gap_p99_ms": 1000 * pct(gaps, 0.99),
        "tokens_per_chunk": sum(s.tokens for s in samples) / chunks if chunks else float("nan"),
        "output_tok_s": sum(s.tokens for s in samples) / elapsed,
    }

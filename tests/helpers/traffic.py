"""Client-side traffic against an OpenAI endpoint, with a deadline on every request.

Each request ends in one `Outcome`: completed, failed with the server's error (HTTP status and
message, or an error event in the stream), or hung (still running at its deadline, then
abandoned). `steady_traffic` keeps `concurrency` streaming completions going until told to
stop; the fault tests and the chaos run read the outcomes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import openai

UNAVAILABLE_TYPE = "service_unavailable"
"""OpenAI's error type of a 503 (the error events of a failed stream carry it too)."""


@dataclass(frozen=True)
class Outcome:
    """How one request ended, in `time.monotonic()` seconds."""

    kind: str
    """What was sent: `good`, `bad` (invalid on purpose) or `disconnect` (client went away)."""
    started: float
    ended: float
    completed: bool = False
    status: int | None = None
    """HTTP status of an error answer (None: completed, or a stream that failed mid-way)."""
    error: str | None = None
    hung: bool = False

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    @property
    def is_unavailable(self) -> bool:
        """Failed with OpenAI's 503 shape: as the HTTP status, or as a stream's error event."""
        return not self.completed and (
            self.status == 503 or (self.error or "").startswith(UNAVAILABLE_TYPE)
        )


def client(base_url: str, deadline_s: float, api_key: str = "unused") -> openai.AsyncOpenAI:
    """An async `openai` client that never retries (every failure is seen)."""
    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=deadline_s + 30
    )


async def _consume(
    api: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int
) -> tuple[bool, str]:
    """Stream one completion to its end: (finished with max_tokens tokens?, text)."""
    stream = await api.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    pieces = []
    finish = None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    return finish is not None, "".join(pieces)


async def stream_completion(
    api: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, deadline_s: float
) -> Outcome:
    """One streaming completion, ended by its result, its error or its deadline."""
    started = time.monotonic()
    try:
        finished, _ = await asyncio.wait_for(
            _consume(api, model, prompt, max_tokens), timeout=deadline_s
        )
    except asyncio.TimeoutError:
        return Outcome("good", started, time.monotonic(), hung=True, error="deadline passed")
    except openai.APIStatusError as error:
        return Outcome(
            "good", started, time.monotonic(), status=error.status_code, error=str(error)
        )
    except openai.APIError as error:  # an error event mid-stream, or the connection broke
        kind = error.type or type(error).__name__
        return Outcome("good", started, time.monotonic(), error=f"{kind}: {error}")
    if not finished:
        return Outcome("good", started, time.monotonic(), error="stream ended without a finish")
    return Outcome("good", started, time.monotonic(), completed=True)


async def steady_traffic(
    base_url: str,
    model: str,
    concurrency: int,
    stop: asyncio.Event,
    deadline_s: float,
    max_tokens: int = 16,
    starts: list[float] | None = None,
) -> list[Outcome]:
    """`concurrency` loops of streaming completions until `stop` is set; every outcome. Each
    request's start time is also appended to `starts` as it is sent, when given."""
    api = client(base_url, deadline_s)
    outcomes: list[Outcome] = []

    async def loop(index: int) -> None:
        count = 0
        while not stop.is_set():
            prompt = " ".join(f"t{(index * 7 + count + j) % 200 + 1}" for j in range(6))
            if starts is not None:
                starts.append(time.monotonic())
            outcomes.append(await stream_completion(api, model, prompt, max_tokens, deadline_s))
            count += 1

    try:
        await asyncio.gather(*(loop(index) for index in range(concurrency)))
    finally:
        await api.close()
    return outcomes

"""How long a stream holds its tokens before sending them as one chunk, chosen by load.

Every streamed chunk costs CPU along the serving path (Serve's proxy, the replica, the client:
about 0.8 ms in all, measured in docs/benchmarks.md), whatever it carries. One chunk per token
per stream is cheap while few requests stream; under load the chunks alone would need more
CPU than the machine has. A `StreamBatching` policy turns the number of streams in flight into
the interval a stream waits between chunks:

- fixed (`interval_ms` given, Ray Serve LLM's `stream_batching_interval_ms`): every stream
  flushes at most once per interval, whatever the load (0: every step's tokens at once);
- adaptive (the default): no wait while at most `FEW_STREAMS` requests stream; beyond that, the
  interval that keeps the replica's chunk rate within `CHUNK_CPU_SHARE` of one core at
  `CHUNK_CPU_S` per chunk, i.e. `streams * CHUNK_CPU_S / CHUNK_CPU_SHARE`.

`HeldChunk` applies a policy to one stream: the first chunk and the final one are never held,
and a chunk goes out once the interval since the previous one has passed. It takes the time as
an argument, so its decisions are testable without a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.outputs import OutputAccumulator, RequestOutput

CHUNK_CPU_S = 0.0008
"""CPU one streamed chunk costs across proxy, replica and client (docs/benchmarks.md)."""
CHUNK_CPU_SHARE = 0.5
"""The share of one core the replica's chunks may take under load."""
FEW_STREAMS = 4
"""Up to this many streams in flight, every token goes out as soon as it is made."""


@dataclass(frozen=True)
class StreamBatching:
    """The interval a stream waits between chunks; `interval_ms` None adapts to the load."""

    interval_ms: float | None = None

    def __post_init__(self) -> None:
        if self.interval_ms is not None and not self.interval_ms >= 0:
            raise ValueError(
                f"stream_batching_interval_ms must be >= 0 (or unset: adapt to the load), "
                f"got {self.interval_ms}"
            )

    def interval_s(self, num_streams: int) -> float:
        """Seconds between two chunks of one stream while `num_streams` streams are in flight."""
        if self.interval_ms is not None:
            return self.interval_ms / 1000
        if num_streams <= FEW_STREAMS:
            return 0.0
        return num_streams * CHUNK_CPU_S / CHUNK_CPU_SHARE

    @property
    def description(self) -> str:
        if self.interval_ms is None:
            return "adaptive"
        return f"{self.interval_ms:g} ms"


class HeldChunk:
    """The deltas of one stream not yet sent, merged, and when they are due."""

    def __init__(self) -> None:
        self._accumulator: OutputAccumulator | None = None
        self._merged: RequestOutput | None = None
        self._num_sent = 0
        self._last_sent = 0.0

    def add(self, delta: RequestOutput) -> None:
        if self._merged is None:  # a lone delta goes out as it is, uncopied
            self._merged = delta
            return
        if self._accumulator is None:
            self._accumulator = OutputAccumulator()
            self._accumulator.add(self._merged)
        self._merged = self._accumulator.add(delta)

    @property
    def empty(self) -> bool:
        return self._merged is None

    def wait_s(self, now: float, interval_s: float) -> float:
        """Seconds to hold the chunk before sending it; 0: send now. The first chunk of the
        stream and the final one (or an interval of 0) are never held."""
        merged = self._merged
        if merged is None:
            raise ValueError("no delta held")
        if self._num_sent == 0 or merged.finished or interval_s <= 0:
            return 0.0
        return max(0.0, self._last_sent + interval_s - now)

    def take(self, now: float) -> RequestOutput:
        """The held deltas as one delta, marked sent at `now`."""
        merged = self._merged
        if merged is None:
            raise ValueError("no delta held")
        self._accumulator, self._merged = None, None
        self._num_sent += 1
        self._last_sent = now
        return merged

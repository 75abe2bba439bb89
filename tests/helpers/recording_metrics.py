"""Stand-ins for the Ray metrics the Serve engine records into, and a scheduler snapshot with
every count at zero, for the tests of the Serve metric series."""

from __future__ import annotations

from scheduler.stats import SchedulerStats


class RecordingCounter:
    """Keeps what the engine adds to a Ray counter (the exporter is not under test)."""

    def __init__(self) -> None:
        self.added: list[tuple[int, dict[str, str]]] = []

    def inc(self, value: int, tags: dict[str, str]) -> None:
        self.added.append((value, tags))

    def total(self, **tags: str) -> int:
        """The sum of the increments whose tags include `tags`."""
        return sum(v for v, t in self.added if all(t.get(k) == w for k, w in tags.items()))


class RecordingGauge:
    """Keeps what the engine sets a Ray gauge to."""

    def __init__(self) -> None:
        self.values: list[tuple[float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values.append((value, tags))


def idle_stats(num_groups: int) -> SchedulerStats:
    """A snapshot of an idle scheduler with `num_groups` KV cache groups (`replace` the rest)."""
    return SchedulerStats(
        num_running_reqs=0,
        num_waiting_reqs=0,
        kv_cache_usage=0.0,
        kv_cache_usage_per_group=(0.0,) * num_groups,
        prefix_cache_queries=(0,) * num_groups,
        prefix_cache_hits=(0,) * num_groups,
        prefix_cache_hit_tokens=0,
        num_preemptions=0,
        num_evictions=0,
    )

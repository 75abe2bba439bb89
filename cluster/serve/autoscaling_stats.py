"""What a model replica reports to Serve's autoscaler (`LLMServer.record_autoscaling_stats`).

Serve polls the replica, keeps each number as a time series and averages it over the
deployment's `look_back_period_s`; the hybrid policy reads them under the names of
`cluster.serve.autoscaling_decision`:

- `kv_pressure:<index>:<kind>`: each KV cache group's pressure (`SchedulerStats.group_pressure`:
  the blocks the group holds against those it holds or can still take), in [0, 1];
- `num_waiting`: requests waiting for admission;
- `ttft_p90_s`: p90 time to first token of the requests whose first token came in the last
  `TTFT_WINDOW_S` seconds (0 when none did, so an idle replica asks for nothing).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence

from cluster.serve.autoscaling_decision import KV_PRESSURE_PREFIX, NUM_WAITING, TTFT_P90
from scheduler.kv_cache.pressure import group_label
from scheduler.stats import SchedulerStats

TTFT_WINDOW_S = 10.0
"""How far back the reported TTFT percentile looks."""
TTFT_QUANTILE = 0.9


class RecentTTFT:
    """Times to first token of the last `window_s` seconds, and their p90."""

    def __init__(self, window_s: float = TTFT_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, ttft_s: float, now: float | None = None) -> None:
        """One request's time to first token, seen at `now` (default: the monotonic clock)."""
        self._samples.append((time.monotonic() if now is None else now, max(ttft_s, 0.0)))

    def quantile(self, q: float = TTFT_QUANTILE, now: float | None = None) -> float:
        """The `q` quantile (nearest rank) of the window's samples; 0 when there are none."""
        now = time.monotonic() if now is None else now
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        values = sorted(ttft for _, ttft in self._samples)
        return values[max(0, math.ceil(q * len(values)) - 1)]


def group_pressures(stats: SchedulerStats, group_kinds: Sequence[str]) -> dict[str, float]:
    """Each KV cache group's pressure in [0, 1], keyed `<index>:<kind>`: the scheduler's
    `group_pressure` (blocks the group holds against those it holds or can take), or, from a
    scheduler without it, the same ratio from the usage shares (free counted pool-wide)."""
    if stats.group_pressure:
        return {group.label: group.pressure for group in stats.group_pressure}
    free = 1.0 - stats.kv_cache_usage
    shares = zip(group_kinds, stats.kv_cache_usage_per_group, strict=True)
    return {
        group_label(index, kind): share / (share + free) if share + free > 0 else 0.0
        for index, (kind, share) in enumerate(shares)
    }


def autoscaling_stats(
    stats: SchedulerStats, group_kinds: Sequence[str], ttft: RecentTTFT
) -> dict[str, float]:
    """The replica's report: pressure per KV cache group, waiting requests, recent p90 TTFT."""
    report = {
        f"{KV_PRESSURE_PREFIX}{label}": pressure
        for label, pressure in group_pressures(stats, group_kinds).items()
    }
    report[NUM_WAITING] = float(stats.num_waiting_reqs)
    report[TTFT_P90] = ttft.quantile()
    return report

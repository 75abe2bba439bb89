"""How many model replicas the hybrid-aware autoscaling policy asks for (plain Python, no Ray).

Each signal gives the replicas that would bring it to its target, as Serve's default policy does
for ongoing requests (`current × observed / target`, rounded up):

- `kv_pressure`: per KV cache group the mean over the replicas of the group's pressure; the
  fullest group counts (a Mamba model's state slots may be full while its attention pages are
  not, and admission stops at the first pool that is full);
- `queue_len`: requests waiting for admission, per replica;
- `ttft`: the replicas' recent p90 time to first token (mean over replicas);
- `ongoing_requests`: Serve's `target_ongoing_requests`, always counted (a floor).

The largest answer wins, bounded by the deployment's minimum and maximum; `Decision` names the
signal that drove it. Serve applies `upscale_delay_s` / `downscale_delay_s` and the scaling
factors to every policy's answer, so they are not applied here a second time.

A replica reports its loads under the names below (`record_autoscaling_stats`); Serve
averages each over `look_back_period_s` before the policy reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.config.autoscaling import HybridPolicySettings

KV_PRESSURE_PREFIX = "kv_pressure:"
"""Metric `kv_pressure:<group index>:<group kind>`: the group's pressure in [0, 1]."""
NUM_WAITING = "num_waiting"
"""Metric: requests waiting for admission in the replica's scheduler."""
TTFT_P90 = "ttft_p90_s"
"""Metric: p90 time to first token of the replica's recent requests (0 when none)."""
ONGOING_REQUESTS = "ongoing_requests"
"""Name of Serve's own signal in decisions."""
_ROUNDING_SLACK = 1e-9


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's reported loads (averaged by Serve over its look-back period)."""

    group_pressure: Mapping[str, float]
    """Pressure per KV cache group, keyed `<index>:<kind>`."""
    num_waiting: float | None = None
    ttft_p90_s: float | None = None

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> ReplicaLoad:
        """A replica's load from its reported metrics (absent ones are None)."""
        pressure = {
            name.removeprefix(KV_PRESSURE_PREFIX): value
            for name, value in metrics.items()
            if name.startswith(KV_PRESSURE_PREFIX)
        }
        return cls(pressure, metrics.get(NUM_WAITING), metrics.get(TTFT_P90))


@dataclass(frozen=True)
class DeploymentLoad:
    """What the policy knows of the deployment at one autoscaling tick."""

    current_num_replicas: int
    min_replicas: int
    max_replicas: int
    replicas: tuple[ReplicaLoad, ...] = ()
    """The loads of the running replicas that have reported."""
    total_ongoing_requests: float = 0.0
    target_ongoing_requests: float | None = None


@dataclass(frozen=True)
class Decision:
    """The replicas asked for and why."""

    num_replicas: int
    signal: str
    """The signal that asked for the most replicas (`min_replicas` when none asked for as
    many as the minimum)."""
    reason: str
    """`<signal> <observed> vs target <target>` with the group for kv_pressure."""
    wanted: Mapping[str, int]
    """Replicas each counted signal asked for, before bounds."""


@dataclass(frozen=True)
class _Ask:
    signal: str
    num_replicas: int
    reason: str


def _replicas_for(current: int, observed: float, target: float) -> int:
    """Replicas that bring `observed` (per replica, over `current` replicas) to `target`."""
    return max(0, math.ceil(current * observed / target - _ROUNDING_SLACK))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _kv_pressure(load: DeploymentLoad, target: float) -> _Ask | None:
    per_group: dict[str, list[float]] = {}
    for replica in load.replicas:
        for group, pressure in replica.group_pressure.items():
            per_group.setdefault(group, []).append(pressure)
    if not per_group:
        return None
    group, pressures = max(per_group.items(), key=lambda item: (_mean(item[1]), item[0]))
    pressure = _mean(pressures)
    wanted = _replicas_for(load.current_num_replicas, pressure, target)
    return _Ask("kv_pressure", wanted, f"group {group} at {pressure:.2f} vs target {target:g}")


def _per_replica(
    load: DeploymentLoad, values: list[float | None], signal: str, target: float, unit: str
) -> _Ask | None:
    reported = [value for value in values if value is not None]
    if not reported:
        return None
    observed = _mean(reported)
    wanted = _replicas_for(load.current_num_replicas, observed, target)
    return _Ask(signal, wanted, f"{observed:.3g}{unit} per replica vs target {target:g}{unit}")


def _ongoing(load: DeploymentLoad) -> _Ask | None:
    target = load.target_ongoing_requests
    if not target:
        return None
    wanted = max(0, math.ceil(load.total_ongoing_requests / target - _ROUNDING_SLACK))
    observed = load.total_ongoing_requests / max(load.current_num_replicas, 1)
    return _Ask(ONGOING_REQUESTS, wanted, f"{observed:.3g} per replica vs target {target:g}")


def _asks(load: DeploymentLoad, settings: HybridPolicySettings) -> list[_Ask]:
    asks = [_ongoing(load)]
    if "kv_pressure" in settings.metrics:
        asks.append(_kv_pressure(load, settings.target_kv_pressure))
    if "queue_len" in settings.metrics:
        waiting = [replica.num_waiting for replica in load.replicas]
        asks.append(_per_replica(load, waiting, "queue_len", settings.target_queue_len, ""))
    if "ttft" in settings.metrics:
        ttfts = [replica.ttft_p90_s for replica in load.replicas]
        asks.append(_per_replica(load, ttfts, "ttft", settings.target_ttft_s, " s"))
    return [ask for ask in asks if ask is not None]


def decide(load: DeploymentLoad, settings: HybridPolicySettings) -> Decision:
    """The replicas the deployment should have, bounded by its min and max, and why. With
    nothing reported yet (replicas starting) it keeps the current count."""
    asks = _asks(load, settings)
    wanted = {ask.signal: ask.num_replicas for ask in asks}
    if not asks:
        top = _Ask("none", load.current_num_replicas, "no signal reported yet")
    else:
        top = max(asks, key=lambda ask: ask.num_replicas)  # first of equals: the floor
    if top.num_replicas < load.min_replicas:
        reason = f"{top.signal} asks {top.num_replicas} ({top.reason})"
        return Decision(load.min_replicas, "min_replicas", reason, wanted)
    if top.num_replicas > load.max_replicas:
        reason = f"{top.reason}; asks {top.num_replicas}, capped by max_replicas"
        return Decision(load.max_replicas, top.signal, reason, wanted)
    return Decision(top.num_replicas, top.signal, top.reason, wanted)

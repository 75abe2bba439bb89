"""The hybrid autoscaling decision: each signal alone scales up, the fullest KV cache group
counts (a Mamba-heavy load scales where request counts alone would not), bounds, and the
up/downscale delays as Serve applies them around the policy (its real wrapper and context)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.config.autoscaling import HYBRID_POLICY, HybridPolicySettings
from cluster.serve.autoscaling_decision import DeploymentLoad, ReplicaLoad, decide
from cluster.serve.autoscaling_policy import hybrid_autoscaling_policy

SETTINGS = HybridPolicySettings(target_kv_pressure=0.8, target_queue_len=4, target_ttft_s=1.0)
IDLE = ReplicaLoad({"0:full_attention": 0.1}, num_waiting=0.0, ttft_p90_s=0.1)


def _load(*replicas: ReplicaLoad, ongoing: float = 0.0, target: float | None = None) -> Any:
    return DeploymentLoad(
        current_num_replicas=len(replicas),
        min_replicas=1,
        max_replicas=8,
        replicas=replicas,
        total_ongoing_requests=ongoing,
        target_ongoing_requests=target,
    )


def test_idle_replicas_scale_down_to_the_minimum() -> None:
    assert decide(_load(IDLE, IDLE, IDLE), SETTINGS).num_replicas == 1


@pytest.mark.parametrize(
    ("busy", "signal"),
    [
        (ReplicaLoad({"0:full_attention": 0.95}, 0.0, 0.1), "kv_pressure"),
        (ReplicaLoad({"0:full_attention": 0.1}, 9.0, 0.1), "queue_len"),
        (ReplicaLoad({"0:full_attention": 0.1}, 0.0, 3.0), "ttft"),
    ],
)
def test_each_signal_alone_scales_up(busy: ReplicaLoad, signal: str) -> None:
    decision = decide(_load(busy, busy), SETTINGS)
    assert decision.num_replicas > 2
    assert decision.signal == signal
    others = HybridPolicySettings(
        metrics=tuple(s for s in ("kv_pressure", "queue_len", "ttft") if s != signal)
    )
    assert decide(_load(busy, busy), others).num_replicas <= 2


def test_a_full_state_group_scales_where_ongoing_requests_would_not() -> None:
    """Few long requests of a Mamba hybrid: its state slots are nearly all taken while its
    attention pages and the request count are far from their targets."""
    mamba_heavy = ReplicaLoad({"0:full_attention": 0.2, "1:mamba": 0.97}, 0.0, 0.2)
    load = _load(mamba_heavy, ongoing=6.0, target=8.0)
    decision = decide(load, SETTINGS)
    assert decision.wanted["ongoing_requests"] == 1
    assert decision.num_replicas == 2
    assert decision.signal == "kv_pressure"
    assert "1:mamba" in decision.reason
    only_requests = HybridPolicySettings(metrics=("queue_len", "ttft"))
    assert decide(load, only_requests).num_replicas == 1


def test_ongoing_requests_are_a_floor() -> None:
    decision = decide(_load(IDLE, ongoing=30.0, target=8.0), SETTINGS)
    assert (decision.num_replicas, decision.signal) == (4, "ongoing_requests")


def test_bounds_cap_the_answer() -> None:
    flooded = ReplicaLoad({"0:full_attention": 1.0}, 400.0, 30.0)
    decision = decide(_load(flooded, flooded), SETTINGS)
    assert (decision.num_replicas, decision.signal) == (8, "queue_len")
    assert decision.wanted["queue_len"] == 200
    assert "capped by max_replicas" in decision.reason


def test_the_minimum_holds_when_no_signal_asks_for_as_many() -> None:
    load = DeploymentLoad(3, min_replicas=2, max_replicas=8, replicas=(IDLE, IDLE, IDLE))
    decision = decide(load, SETTINGS)
    assert (decision.num_replicas, decision.signal) == (2, "min_replicas")


def test_nothing_reported_keeps_the_count() -> None:
    load = DeploymentLoad(current_num_replicas=3, min_replicas=1, max_replicas=8)
    assert decide(load, SETTINGS).num_replicas == 3


DEPLOYMENT = DeploymentID(name="LLMServer:tiny", app_name="app")
REPLICAS = [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(3)]
DELAY_S = 0.3


def _context(num_replicas: int, num_waiting: float, state: dict[str, Any]) -> AutoscalingContext:
    config = AutoscalingConfig(
        min_replicas=1,
        max_replicas=3,
        upscale_delay_s=DELAY_S,
        downscale_delay_s=DELAY_S,
        policy={"policy_function": HYBRID_POLICY, "policy_kwargs": {"target_queue_len": 2}},
    )
    running = REPLICAS[:num_replicas]
    return AutoscalingContext(
        deployment_id=DEPLOYMENT,
        deployment_name=DEPLOYMENT.name,
        app_name=DEPLOYMENT.app_name,
        current_num_replicas=num_replicas,
        target_num_replicas=num_replicas,
        running_replicas=running,
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics={"num_waiting": dict.fromkeys(running, num_waiting)},
        raw_metrics={},
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=3,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=time.time(),
        config=config,
    )


def _replicas_over_time(num_waiting: float, start: int, seconds: float) -> list[tuple[float, int]]:
    """Serve's loop: the wrapped policy every 50 ms, its answer the next tick's count."""
    policy = _apply_autoscaling_config(hybrid_autoscaling_policy)
    state: dict[str, Any] = {}
    replicas, begin, seen = start, time.monotonic(), []
    while time.monotonic() - begin < seconds:
        replicas, state = policy(_context(replicas, num_waiting, state))
        seen.append((time.monotonic() - begin, replicas))
        time.sleep(0.05)
    return seen


def _first_change(seen: list[tuple[float, int]], start: int) -> float:
    return next(elapsed for elapsed, replicas in seen if replicas != start)


def test_upscale_waits_for_upscale_delay() -> None:
    seen = _replicas_over_time(num_waiting=5.0, start=1, seconds=2 * DELAY_S)
    assert _first_change(seen, 1) >= DELAY_S
    assert seen[-1][1] == 3


def test_downscale_waits_for_downscale_delay() -> None:
    seen = _replicas_over_time(num_waiting=0.0, start=3, seconds=2 * DELAY_S)
    assert _first_change(seen, 3) >= DELAY_S
    assert seen[-1][1] == 1

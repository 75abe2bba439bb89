"""The hybrid-aware autoscaling policy of Ray Serve's custom policy hook.

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      upscale_delay_s: 30
      downscale_delay_s: 600
      policy:
        policy_function: cluster.serve.autoscaling_policy:hybrid_autoscaling_policy
        policy_kwargs: {target_kv_pressure: 0.8, target_queue_len: 10, target_ttft_s: 2.0,
                        metrics: [kv_pressure, queue_len, ttft]}

Serve's controller calls `hybrid_autoscaling_policy(ctx)` every control-loop tick with the
replicas' reports (`LLMServer.record_autoscaling_stats`, averaged over `look_back_period_s`) and
wraps it as it wraps every policy: the scaling factors and the up/downscale delays are applied
to its answer (their timers live in `ctx.policy_state`), then min/max. The decision itself is
`cluster.serve.autoscaling_decision.decide`; this module reads the context into it and logs, in
the controller's log, what the policy asks for whenever the count or the driving signal changes,
and which signal drove each change of the replica count.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve._private.constants import SERVE_LOGGER_NAME
from ray.serve.config import AutoscalingContext

from cluster.config.autoscaling import hybrid_policy_settings
from cluster.serve.autoscaling_decision import Decision, DeploymentLoad, ReplicaLoad, decide

logger = logging.getLogger(SERVE_LOGGER_NAME)

_LAST_ASK = "hybrid_last_ask"
"""Policy-state key: the last decision's (replicas, signal, reason), to log changes only."""
_LAST_TARGET = "hybrid_last_target"
"""Policy-state key: Serve's target replica count at the last tick."""


def deployment_load(ctx: AutoscalingContext) -> DeploymentLoad:
    """The decision's view of an autoscaling context: each running replica's reported loads."""
    metrics = ctx.aggregated_metrics or {}
    per_replica: dict[Any, dict[str, float]] = {}
    for name, values in metrics.items():
        for replica_id, value in values.items():
            per_replica.setdefault(replica_id, {})[name] = float(value)
    running = set(ctx.running_replicas)
    replicas = tuple(
        ReplicaLoad.from_metrics(loads)
        for replica_id, loads in per_replica.items()
        if replica_id in running
    )
    return DeploymentLoad(
        current_num_replicas=ctx.current_num_replicas,
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        replicas=replicas,
        total_ongoing_requests=float(ctx.total_num_requests or 0.0),
        target_ongoing_requests=ctx.config.get_target_ongoing_requests() if ctx.config else None,
    )


def _log(ctx: AutoscalingContext, decision: Decision, state: dict[str, Any]) -> None:
    name = ctx.deployment_name
    ask = [decision.num_replicas, decision.signal, decision.reason]
    target = ctx.target_num_replicas
    last_target = state.get(_LAST_TARGET)
    last_ask = state.get(_LAST_ASK)
    if last_target is not None and target != last_target and last_ask is not None:
        logger.info(
            "%s: replicas %d -> %d, driven by %s (%s)",
            name,
            last_target,
            target,
            last_ask[1],
            last_ask[2],
        )
    if last_ask is None or ask[:2] != last_ask[:2]:  # the count or the driving signal
        asked = ", ".join(f"{signal} {count}" for signal, count in decision.wanted.items())
        logger.info(
            "%s: hybrid policy asks %d replica(s) (now %d), driven by %s (%s); signals: %s",
            name,
            decision.num_replicas,
            target,
            decision.signal,
            decision.reason,
            asked,
        )
    state[_LAST_ASK] = ask
    state[_LAST_TARGET] = target


def hybrid_autoscaling_policy(ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
    """The replicas the deployment should have (before Serve's delays), and the policy state."""
    policy = ctx.config.policy if ctx.config is not None else None
    settings = hybrid_policy_settings(policy.policy_kwargs if policy is not None else None)
    decision = decide(deployment_load(ctx), settings)
    state = dict(ctx.policy_state)
    _log(ctx, decision, state)
    return decision.num_replicas, state

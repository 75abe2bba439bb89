"""`deployment_config.autoscaling_config`, checked when the config is validated (before deploy).

Serve checks an autoscaling config only when the application is deployed, and some mistakes
not even then (`min_replicas` above `max_replicas` inside a Serve config file fails in the
controller). Here the config is validated with Serve's own `AutoscalingConfig` when the
`LLMConfig` is, so `hybridserve config validate`, `build_openai_app` and the Helm values fail
early with one line naming the key. The hybrid policy's settings (`policy_kwargs` of
`HYBRID_POLICY`) are checked by `HybridPolicySettings`.

The hybrid policy scales on these signals, chosen with `policy_kwargs.metrics`:

- `kv_pressure`: the fullest KV cache group (attention pages, sliding-window pages, state
  slots, ...) against `target_kv_pressure`;
- `queue_len`: requests waiting for admission per replica against `target_queue_len`;
- `ttft`: the replicas' recent p90 time to first token against `target_ttft_s`.

Serve's `target_ongoing_requests` always counts as a floor.
"""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field, ValidationError, field_validator

from cluster.config.base import StrictModel
from cluster.config.errors import format_validation_error, unknown_key_message

HYBRID_POLICY = "cluster.serve.autoscaling_policy:hybrid_autoscaling_policy"
"""The import path of the hybrid-aware policy (`autoscaling_config.policy.policy_function`)."""
SIGNALS = ("kv_pressure", "queue_len", "ttft")
"""The signals the hybrid policy can scale on."""
_WHERE = "autoscaling_config"


class HybridPolicySettings(StrictModel):
    """`policy_kwargs` of the hybrid policy: which signals count, and each one's target."""

    key_name = "policy setting"

    metrics: tuple[str, ...] = Field(
        SIGNALS,
        min_length=1,
        description="Signals that count: kv_pressure, queue_len, ttft (default all three); "
        "Serve's target_ongoing_requests always counts as a floor.",
    )
    target_kv_pressure: float = Field(
        0.8,
        description="Fraction of its fullest KV cache group each replica should hold, in (0, 1].",
    )
    target_queue_len: float = Field(
        10.0, gt=0, description="Requests waiting for admission each replica should hold."
    )
    target_ttft_s: float = Field(
        2.0, gt=0, description="p90 time to first token (seconds) each replica should keep."
    )

    @field_validator("metrics", mode="before")
    @classmethod
    def _known_metrics(cls, names: Any) -> Any:
        if isinstance(names, list | tuple):
            if not names:
                raise ValueError(f"name at least one signal ({', '.join(SIGNALS)})")
            for name in names:
                if name not in SIGNALS:
                    raise ValueError(unknown_key_message(str(name), SIGNALS, "metric"))
            return tuple(names)
        return names

    @field_validator("target_kv_pressure")
    @classmethod
    def _pressure_in_range(cls, pressure: float) -> float:
        if not 0 < pressure <= 1:
            raise ValueError(f"must be in (0, 1] (a fraction of the pool), got {pressure!r}")
        return pressure


def hybrid_policy_settings(kwargs: dict[str, Any] | None) -> HybridPolicySettings:
    """The hybrid policy's settings from its `policy_kwargs`; ValueError in one line."""
    try:
        return HybridPolicySettings.model_validate(kwargs or {})
    except ValidationError as error:
        where = f"{_WHERE}.policy.policy_kwargs"
        raise ValueError(format_validation_error(error, where)) from None


def check_autoscaling_config(config: Any, num_replicas: Any = None) -> None:
    """Validate an `autoscaling_config` as Serve will (bounds, delays, targets, the policy's
    import path; over Serve's `num_replicas: auto` defaults when so set) and, for the hybrid
    policy, its settings; ValueError in one line."""
    if config is None and num_replicas != "auto":
        return
    if config is not None and not isinstance(config, dict):
        return  # Serve's deployment schema names the type
    from ray.serve.config import AutoscalingConfig

    config = config or {}
    policy = config.get("policy")
    if isinstance(policy, dict) and policy.get("policy_function") == HYBRID_POLICY:
        hybrid_policy_settings(policy.get("policy_kwargs"))
    if num_replicas == "auto":
        serve_auto = AutoscalingConfig.default()  # type: ignore[no-untyped-call]
        config = {**serve_auto.model_dump(exclude_unset=True), **config}
    try:
        with warnings.catch_warnings():  # Serve's deprecation notes are not config errors
            warnings.simplefilter("ignore")
            AutoscalingConfig.model_validate(config)
    except ValidationError as error:
        raise ValueError(format_validation_error(error, _WHERE).rstrip("!")) from None
    except (ImportError, AttributeError, ValueError) as error:
        function = policy.get("policy_function") if isinstance(policy, dict) else policy
        raise ValueError(
            f"{_WHERE}.policy.policy_function: cannot import {function!r} ({error})"
        ) from None

"""Ray Serve deployment options and placement-group bundles, as users write them in YAML.

`deployment_config` stays the plain dict handed to `serve.deployment(...)`; `DeploymentOptions`
only checks it (known keys, value types) so that a typo fails at validation, not at deploy time.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator

from cluster.config.base import StrictModel
from cluster.config.errors import format_validation_error

_PLACEMENT_HINT = (
    "{key} is not a deployment_config option: set placement_group_config.{field} instead"
)


class DeploymentOptions(StrictModel):
    """The `@serve.deployment` options a model or ingress deployment may set."""

    moved_keys: ClassVar[dict[str, str]] = {
        "placement_group_bundles": _PLACEMENT_HINT.format(
            key="placement_group_bundles", field="bundles"
        ),
        "placement_group_strategy": _PLACEMENT_HINT.format(
            key="placement_group_strategy", field="strategy"
        ),
    }

    name: str | None = Field(None, description="Deployment name (default derived from model_id).")
    num_replicas: int | Literal["auto"] | None = Field(
        None, description="Fixed replica count, or 'auto' for Serve's default autoscaling."
    )
    ray_actor_options: dict[str, Any] | None = Field(
        None, description="Resources of the replica actor (num_cpus, num_gpus, memory, ...)."
    )
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests one replica handles at once before Serve queues."
    )
    max_queued_requests: int | None = Field(
        None, ge=-1, description="Requests queued per caller before 503 (-1: unlimited)."
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Serve autoscaling: min_replicas, max_replicas, target_ongoing_requests."
    )
    user_config: Any = Field(None, description="Passed to the replica's reconfigure().")
    health_check_period_s: float | None = Field(
        None, gt=0, description="Seconds between replica health checks."
    )
    health_check_timeout_s: float | None = Field(
        None, gt=0, description="Seconds before a health check counts as failed."
    )
    graceful_shutdown_wait_loop_s: float | None = Field(
        None, gt=0, description="Seconds between drain checks while shutting down."
    )
    graceful_shutdown_timeout_s: float | None = Field(
        None, ge=0, description="Seconds a draining replica may finish in-flight requests."
    )
    logging_config: dict[str, Any] | None = Field(
        None, description="Serve logging: log_level, encoding, logs_dir, enable_access_log."
    )
    request_router_config: dict[str, Any] | None = Field(
        None, description="request_router_class and request_router_kwargs (prefix-aware routing)."
    )

    @field_validator("num_replicas", mode="before")
    @classmethod
    def _check_num_replicas(cls, value: Any) -> Any:
        is_count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if value is None or value == "auto" or is_count:
            return value
        raise ValueError(f"must be an integer >= 0 or 'auto', got {value!r}")


def check_deployment_config(options: dict[str, Any]) -> dict[str, Any]:
    """Validate a deployment_config dict and return it unchanged (ValueError on a bad key)."""
    try:
        DeploymentOptions.model_validate(options)
    except ValidationError as error:
        raise ValueError(format_validation_error(error)) from None
    return options


PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class PlacementGroupConfig(StrictModel):
    """The placement group of one model replica: one bundle per tensor-parallel rank."""

    bundles: list[dict[str, float]] = Field(
        min_length=1,
        description="Resource dicts, one per rank, e.g. [{GPU: 1, CPU: 2}, {GPU: 1}]; "
        "the replica itself is placed in bundle 0.",
    )
    strategy: PlacementStrategy = Field(
        "PACK", description="How Ray spreads the bundles over nodes."
    )

    @field_validator("bundles")
    @classmethod
    def _check_bundles(cls, bundles: list[dict[str, float]]) -> list[dict[str, float]]:
        for index, bundle in enumerate(bundles):
            if not bundle:
                raise ValueError(f"bundle {index} is empty: give at least one resource")
            negative = [name for name, amount in bundle.items() if amount < 0]
            if negative:
                raise ValueError(f"bundle {index}: resource {negative[0]!r} is negative")
        return bundles

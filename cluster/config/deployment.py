"""Ray Serve deployment options and placement-group bundles, as users write them in YAML.

`deployment_config` stays the plain dict handed to `serve.deployment(...)`; it is checked with
Serve's own config-file schema (`ray.serve.schema.DeploymentSchema`: known keys, value types) so
that a typo fails at validation, not at deploy time. Ray is imported only when there is
something to check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from cluster.config.autoscaling import check_autoscaling_config
from cluster.config.base import StrictModel
from cluster.config.errors import format_validation_error, unknown_key_message

_PLACEMENT_HINT = (
    "{key} is not a deployment_config option: set placement_group_config.{field} instead"
)
MOVED_KEYS = {
    "placement_group_bundles": _PLACEMENT_HINT.format(
        key="placement_group_bundles", field="bundles"
    ),
    "placement_group_strategy": _PLACEMENT_HINT.format(
        key="placement_group_strategy", field="strategy"
    ),
}
"""Serve options that our configs set elsewhere, mapped to the message that says where."""


def check_deployment_config(options: dict[str, Any]) -> dict[str, Any]:
    """Validate a deployment_config dict and return it unchanged (ValueError on a bad key)."""
    if not options:
        return options
    from ray.serve.schema import DeploymentSchema

    for key in options:
        if key in MOVED_KEYS:
            raise ValueError(MOVED_KEYS[key])
        if key not in DeploymentSchema.model_fields:
            raise ValueError(unknown_key_message(str(key), DeploymentSchema.model_fields))
    check_autoscaling_config(options.get("autoscaling_config"), options.get("num_replicas"))
    data = {"name": "deployment", **options}  # the builder names deployments when none is given
    router = options.get("request_router_config")
    if isinstance(router, Mapping):
        # Serve imports the router class while validating; it may exist only on the cluster
        # (its runtime env), so it is left to deployment and the other router options checked.
        data["request_router_config"] = {
            key: value for key, value in router.items() if key != "request_router_class"
        }
    try:
        DeploymentSchema.model_validate(data, strict=True)
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

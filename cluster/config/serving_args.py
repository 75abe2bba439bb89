"""`LLMServingArgs` (the argument of `build_openai_app`) and whole-file validation.

`validate_config_file` backs `hybridserve config validate`: it accepts an LLMConfig YAML, an
LLMServingArgs YAML, or a Serve config file whose `applications[].args` are LLMServingArgs.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from cluster.config.base import StrictModel
from cluster.config.deployment import check_deployment_config
from cluster.config.errors import format_validation_error
from cluster.config.llm_config import LLMConfig, load_yaml_mapping


class LLMServingArgs(StrictModel):
    """The models of one OpenAI application and the options of its ingress deployment."""

    llm_configs: list[LLMConfig] = Field(
        description="One LLMConfig per served model: objects, dicts or paths to YAML files."
    )
    ingress_deployment_config: dict[str, Any] = Field(
        default_factory=dict, description="Options passed to serve.deployment for the ingress."
    )
    topology: Literal["auto", "one_hop", "two_hop"] = Field(
        default="auto",
        description="one_hop: the model deployment serves the OpenAI routes itself (one model; "
        "the ingress options give it only their env_vars); two_hop: an ingress deployment in "
        "front of one deployment per model; auto: one_hop for one model with one replica and "
        "no request_router_config, else two_hop (a router reads the parsed request only the "
        "ingress passes on; Serve's proxy prefers replicas on its own node, so only the "
        "ingress's handle spreads requests over several replicas).",
    )

    @field_validator("llm_configs", mode="before")
    @classmethod
    def _load_paths(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [load_yaml_mapping(item) if isinstance(item, str | Path) else item for item in value]

    @field_validator("llm_configs")
    @classmethod
    def _check_ids(cls, configs: list[LLMConfig]) -> list[LLMConfig]:
        if not configs:
            raise ValueError("empty list: give at least one model")
        repeated = [
            name for name, count in Counter(c.model_id for c in configs).items() if count > 1
        ]
        if repeated:
            raise ValueError(f"duplicate model_id {repeated[0]!r}: each model needs its own id")
        return configs

    @field_validator("ingress_deployment_config")
    @classmethod
    def _check_ingress(cls, options: dict[str, Any]) -> dict[str, Any]:
        return check_deployment_config(options)

    @field_validator("topology")
    @classmethod
    def _check_topology(cls, topology: str, info: ValidationInfo) -> str:
        configs = info.data.get("llm_configs") or []
        if topology == "one_hop" and len(configs) > 1:
            raise ValueError("one_hop serves one model; use two_hop (or auto) for several")
        return topology

    @property
    def uses_one_hop(self) -> bool:
        """Whether the model deployment serves the routes itself."""
        if self.topology != "auto":
            return self.topology == "one_hop"
        (first, *others) = self.llm_configs
        options = first.deployment_config
        one_replica = options.get("num_replicas", 1) == 1 and "autoscaling_config" not in options
        return not others and one_replica and not options.get("request_router_config")

    @property
    def model_ids(self) -> list[str]:
        """The served model names, in order."""
        return [config.model_id for config in self.llm_configs]


def _serving_args_of(data: dict[str, Any]) -> list[LLMServingArgs]:
    if "applications" in data:
        apps = data["applications"]
        if not isinstance(apps, list) or not apps:
            raise ValueError("applications must be a non-empty list")
        result = []
        for index, app in enumerate(apps):
            if not isinstance(app, dict):
                raise ValueError(f"applications.{index} must be a mapping")
            where = f"applications.{index}.args"
            result.append(_validate(LLMServingArgs, app.get("args", {}), where))
        return result
    if "llm_configs" in data:
        return [_validate(LLMServingArgs, data, "")]
    return [LLMServingArgs(llm_configs=[_validate(LLMConfig, data, "")])]


def _validate(model: type[Any], data: Any, where: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ValueError(format_validation_error(error, prefix=where)) from None


def validate_config_file(path: str | Path) -> list[str]:
    """Validate a config file of any of the kinds (with `prefill_config` / `decode_config`: a
    prefill/decode-disaggregated model); return the model ids it serves."""
    from cluster.config.pd_args import PDServingArgs

    data = load_yaml_mapping(path)
    if "prefill_config" in data or "decode_config" in data:
        pd_args: PDServingArgs = _validate(PDServingArgs, data, "")
        return [pd_args.decode_config.model_id]
    args = _serving_args_of(data)
    return [model_id for serving_args in args for model_id in serving_args.model_ids]

"""`LLMConfig`: one served model, with Ray Serve LLM's field names.

A user's `serveConfigV2` block for `ray.serve.llm:build_openai_app` moves over by changing only
the import path. `engine_kwargs` use vLLM's names and are checked against `EngineArgs`.

Model sources:
- `org/name` or `hf://org/name`: a Hugging Face model id (`hf://` is stripped);
- `pvc://CLAIM/PATH`: a PersistentVolumeClaim, mounted by the Helm chart at `/mnt/pvc/CLAIM`,
  so the engine reads `/mnt/pvc/CLAIM/PATH`;
- anything else: a local path, used as is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, Field, field_validator, model_validator

from cluster.config.base import StrictModel
from cluster.config.deployment import PlacementGroupConfig, check_deployment_config
from cluster.config.engine_args import (
    EngineArgs,
    resolve_executor_backend,
    validate_engine_kwargs,
)

PVC_MOUNT_ROOT = "/mnt/pvc"
"""Where a `pvc://CLAIM/...` source's claim is mounted in every Ray pod."""

_SCHEMES = ("hf://", "pvc://")
_FROM_MODEL_LOADING = ("model", "served_model_name")
STREAM_BATCHING_KEY = "stream_batching_interval_ms"


def resolve_source(source: str) -> str:
    """The model argument the engine gets for a `model_source` (see the module docstring)."""
    if source.startswith("hf://"):
        return source.removeprefix("hf://")
    if source.startswith("pvc://"):
        return f"{PVC_MOUNT_ROOT}/{source.removeprefix('pvc://')}"
    return source


def _check_source(source: str | None) -> str | None:
    if source is None or "://" not in source:
        return source
    if not source.startswith(_SCHEMES):
        scheme = source.split("://", 1)[0]
        raise ValueError(
            f"model source scheme {scheme + '://'!r} is not supported "
            "(use hf://ORG/NAME, pvc://CLAIM/PATH, a local path or a Hugging Face id)"
        )
    if not source.split("://", 1)[1].strip("/"):
        raise ValueError(f"model source {source!r} names no model")
    return source


ModelSource = Annotated[str | None, AfterValidator(_check_source)]


class ModelLoadingConfig(StrictModel):
    """Which model is served, and under which name."""

    model_id: str = Field(min_length=1, description="The name clients send as `model`.")
    model_source: ModelSource = Field(
        None,
        description="hf://ORG/NAME, pvc://CLAIM/PATH, a local path or an HF id; "
        "defaults to model_id.",
    )
    tokenizer_source: ModelSource = Field(
        None, description="Where the tokenizer comes from; defaults to model_source."
    )

    @property
    def source(self) -> str:
        """model_source, or model_id when none was given."""
        return self.model_source or self.model_id


def _check_serving_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    for key in _FROM_MODEL_LOADING:
        if key in kwargs:
            raise ValueError(
                f"{key!r} is not allowed in engine_kwargs: "
                "it comes from model_loading_config (model_id, model_source)"
            )
    resolve_executor_backend(validate_engine_kwargs(kwargs), "serve_replica")
    return kwargs


def _check_experimental(configs: dict[str, Any]) -> dict[str, Any]:
    interval = configs.get(STREAM_BATCHING_KEY)
    if interval is not None and (
        isinstance(interval, bool) or not isinstance(interval, int | float) or interval < 0
    ):
        raise ValueError(
            f"experimental_configs.{STREAM_BATCHING_KEY} must be a number of milliseconds >= 0 "
            f"(or null: adapt to the load), got {interval!r}"
        )
    return configs


class LLMConfig(StrictModel):
    """One model served by one deployment (Ray Serve LLM's `LLMConfig` field names)."""

    model_loading_config: ModelLoadingConfig = Field(
        description="model_id (the served name), model_source and tokenizer_source."
    )
    engine_kwargs: Annotated[dict[str, Any], AfterValidator(_check_serving_engine_kwargs)] = Field(
        default_factory=dict,
        description="Engine arguments in vLLM spelling (tensor_parallel_size, "
        "max_model_len, ...); unknown keys are errors.",
    )
    placement_group_config: PlacementGroupConfig | None = Field(
        None, description="Bundles and strategy; default one bundle per rank, PACK."
    )
    deployment_config: Annotated[dict[str, Any], AfterValidator(check_deployment_config)] = Field(
        default_factory=dict,
        description="Options passed to serve.deployment (autoscaling_config, "
        "max_ongoing_requests, graceful_shutdown_timeout_s, request_router_config, ...).",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict, description="Ray runtime env of the replica and its workers."
    )
    accelerator_type: str | None = Field(
        None,
        min_length=1,
        description="GPU type (A10G, L4, H100, ...): adds an accelerator_type resource "
        "to every bundle.",
    )
    log_engine_metrics: bool = Field(
        True, description="Export engine metrics (vllm:* names) on Ray's metrics port."
    )
    experimental_configs: Annotated[dict[str, Any], AfterValidator(_check_experimental)] = Field(
        default_factory=dict,
        description="Unstable options: stream_batching_interval_ms (how long a stream holds "
        "its tokens; unset or null adapts to the load, 0 sends every step's tokens at once).",
    )
    tool_call_parser: str = Field(
        "hermes",
        description="How `tool_choice: auto` replies are read: hermes (qwen), llama3_json, "
        "mistral or openai (gpt_oss); see cluster/openai_api/tool_parsers.",
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _known_tool_parser(cls, name: str) -> str:
        from cluster.openai_api.tool_parsers import get_tool_parser

        get_tool_parser(name)
        return name

    @model_validator(mode="after")
    def _check_bundle_count(self) -> LLMConfig:
        tp_size = self.tensor_parallel_size
        pg = self.placement_group_config
        if pg is not None and len(pg.bundles) < tp_size:
            raise ValueError(
                f"placement_group_config has {len(pg.bundles)} bundle(s) but "
                f"tensor_parallel_size is {tp_size}: give one bundle per rank"
            )
        return self

    @classmethod
    def from_file(cls, path: str | Path) -> LLMConfig:
        """Load one LLMConfig from a YAML file."""
        return cls.model_validate(load_yaml_mapping(path))

    @property
    def model_id(self) -> str:
        """The name clients send as `model`."""
        return self.model_loading_config.model_id

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks per replica (engine_kwargs.tensor_parallel_size, default 1)."""
        return int(self.engine_kwargs.get("tensor_parallel_size", 1))

    @property
    def stream_batching_interval_ms(self) -> float | None:
        """The fixed interval a stream holds its tokens; None adapts to the load."""
        interval = self.experimental_configs.get(STREAM_BATCHING_KEY)
        return None if interval is None else float(interval)

    def engine_args(self) -> EngineArgs:
        """The engine arguments of this model, its source resolved to what the engine loads."""
        model = resolve_source(self.model_loading_config.source)
        return EngineArgs(model=model, **self.engine_kwargs)

    def placement_bundles(self, use_gpu: bool) -> list[dict[str, float]]:
        """The replica's placement-group bundles: the configured ones, or one per rank."""
        if self.placement_group_config is not None:
            bundles = [dict(bundle) for bundle in self.placement_group_config.bundles]
        else:
            bundles = [
                {"GPU": 1.0} if use_gpu else {"CPU": 1.0} for _ in range(self.tensor_parallel_size)
            ]
        if self.accelerator_type:
            for bundle in bundles:
                bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundles

    @property
    def placement_strategy(self) -> str:
        """The placement-group strategy (PACK unless configured)."""
        pg = self.placement_group_config
        return pg.strategy if pg is not None else "PACK"


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; ValueError naming the file otherwise."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {error}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a YAML mapping, got {type(data).__name__}")
    return data

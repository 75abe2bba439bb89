"""Serving configuration: what users write in YAML, Serve configs and Helm values.

`LLMConfig` and `LLMServingArgs` keep Ray Serve LLM's field names; `EngineArgs` is the one
definition of engine arguments, and `validate_engine_kwargs` their one check, shared with
`LLM(**kwargs)` and the CLI.
"""

from __future__ import annotations

from cluster.config.deployment import PlacementGroupConfig
from cluster.config.engine_args import (
    EngineArgs,
    ExecutorSite,
    resolve_executor_backend,
    validate_engine_kwargs,
)
from cluster.config.env import API_KEY_ENV, api_key_from_env
from cluster.config.errors import format_validation_error
from cluster.config.llm_config import (
    PVC_MOUNT_ROOT,
    LLMConfig,
    ModelLoadingConfig,
    resolve_source,
)
from cluster.config.serving_args import LLMServingArgs, validate_config_file

__all__ = [
    "API_KEY_ENV",
    "PVC_MOUNT_ROOT",
    "EngineArgs",
    "ExecutorSite",
    "LLMConfig",
    "LLMServingArgs",
    "ModelLoadingConfig",
    "PlacementGroupConfig",
    "api_key_from_env",
    "format_validation_error",
    "resolve_executor_backend",
    "resolve_source",
    "validate_config_file",
    "validate_engine_kwargs",
]

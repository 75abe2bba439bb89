"""Serving configuration: what users write in YAML, Serve configs and Helm values.

`LLMConfig` and `LLMServingArgs` keep Ray Serve LLM's field names; `validate_engine_kwargs` is the
one check of engine arguments, shared with `LLM(**kwargs)` and the CLI.
"""

from __future__ import annotations

from cluster.config.deployment import DeploymentOptions, PlacementGroupConfig
from cluster.config.engine_kwargs import validate_engine_kwargs
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
    "DeploymentOptions",
    "LLMConfig",
    "LLMServingArgs",
    "ModelLoadingConfig",
    "PlacementGroupConfig",
    "api_key_from_env",
    "format_validation_error",
    "resolve_source",
    "validate_config_file",
    "validate_engine_kwargs",
]

"""What `hybridserve serve` deploys and prints: the default application's import path, the gRPC
servicer, builders named by import path, the API key in the ingress's environment, and the
command's progress lines. Shared by the command and its Serve session."""

from __future__ import annotations

import importlib
import sys
from typing import Any

DEFAULT_IMPORT_PATH = "cluster.serve:build_openai_app"
PD_IMPORT_PATH = "cluster.serve:build_pd_openai_app"
"""A config file with prefill_config / decode_config deploys prefill/decode disaggregation."""
SERVICER = "cluster.serve.grpc.llm_pb2_grpc.add_LLMServiceServicer_to_server"


def say(line: str) -> None:
    """A progress line of the command on stdout (flushed: tests and scripts read it live)."""
    sys.stdout.write(f"hybridserve: {line}\n")
    sys.stdout.flush()


def builder(import_path: str) -> Any:
    """The application builder an import path (`module:attr`) names."""
    module, _, attr = import_path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def with_api_key(app_args: dict[str, Any], api_key: str | None) -> dict[str, Any]:
    """The app's args with the ingress's environment holding the API key."""
    if api_key is None:
        return app_args
    from cluster.config.env import API_KEY_ENV

    ingress = dict(app_args.get("ingress_deployment_config") or {})
    actor = dict(ingress.get("ray_actor_options") or {})
    env = dict(actor.get("runtime_env") or {})
    env["env_vars"] = {**env.get("env_vars", {}), API_KEY_ENV: api_key}
    actor["runtime_env"] = env
    ingress["ray_actor_options"] = actor
    return {**app_args, "ingress_deployment_config": ingress}

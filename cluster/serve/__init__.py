"""The Ray Serve application: OpenAI HTTP and gRPC ingress in front of one engine per model.

`cluster.serve:build_openai_app` (`build_pd_openai_app` for prefill/decode disaggregation) is the
import path of Serve config files and of the Helm chart's serveConfigV2;
`cluster.serve.grpc.llm_pb2_grpc.add_LLMServiceServicer_to_server` is the gRPC servicer function.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# The builders import Ray Serve; they load on first use, so that a module of this package that
# needs no Ray (errors, formatting) can be imported before a command has set up Ray's token.
_HOMES = {
    "build_llm_deployment": "cluster.serve.builder",
    "build_openai_app": "cluster.serve.builder",
    "deployment_name": "cluster.serve.builder",
    "build_pd_openai_app": "cluster.serve.pd_app",
}

__all__ = ["build_llm_deployment", "build_openai_app", "build_pd_openai_app", "deployment_name"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)

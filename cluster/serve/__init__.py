"""The Ray Serve application: OpenAI HTTP and gRPC ingress in front of one engine per model.

`cluster.serve:build_openai_app` (`build_pd_openai_app` for prefill/decode disaggregation) is the
import path of Serve config files and of the Helm chart's serveConfigV2;
`cluster.serve.grpc.llm_pb2_grpc.add_LLMServiceServicer_to_server` is the gRPC servicer function.
"""

from __future__ import annotations

from cluster.serve.builder import build_llm_deployment, build_openai_app, deployment_name
from cluster.serve.pd_app import build_pd_openai_app

__all__ = ["build_llm_deployment", "build_openai_app", "build_pd_openai_app", "deployment_name"]

"""`build_pd_openai_app`: prefill/decode disaggregation with Ray Serve LLM's argument shape.

One application: the OpenAI ingress in front of the decode deployment (`Decode:LLMServer:<id>`),
which holds a handle to the prefill deployment (`Prefill:LLMServer:<id>`). Both load the same
model with prefix caching on; clients name the decode config's model_id.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from cluster.config import format_validation_error
from cluster.config.pd_args import PDServingArgs
from cluster.engine.kv_transfer_ray import log_transport
from cluster.serve.builder import ingress_deployment_options, llm_deployment_options
from cluster.serve.ingress import OpenAiIngressDeployment
from cluster.serve.pd_server import PDDecodeServer, PDPrefillServer


def build_pd_openai_app(pd_serving_args: PDServingArgs | dict[str, Any]) -> Application:
    """The P/D OpenAI application (`pd_serving_args`: prefill_config, decode_config, …)."""
    try:
        args = PDServingArgs.model_validate(pd_serving_args)
    except ValidationError as error:
        raise ValueError(format_validation_error(error)) from None
    log_transport(args.prefill_config.engine_kwargs.get("kv_transfer_transport", "object_store"))
    prefill_options = llm_deployment_options(args.prefill_config, "Prefill:")
    prefill: Any = serve.deployment(PDPrefillServer)
    prefill_app = prefill.options(**prefill_options).bind(args.prefill_config.model_dump())
    decode_options = llm_deployment_options(args.decode_config, "Decode:")
    decode: Any = serve.deployment(PDDecodeServer)
    decode_app = decode.options(**decode_options).bind(
        args.decode_config.model_dump(), prefill_app, args.kv_transfer_timeout_s
    )
    ingress_options = ingress_deployment_options(args.ingress_deployment_config)
    ingress: Any = serve.deployment(OpenAiIngressDeployment)
    app: Application = ingress.options(**ingress_options).bind(
        {args.decode_config.model_id: decode_app}
    )
    return app

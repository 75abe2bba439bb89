"""Serve application builders, with Ray Serve LLM's contract.

`build_openai_app(args)` validates `args` as `LLMServingArgs` and returns one application: an
`OpenAiIngress` deployment bound to one `LLMServer:<model>` deployment per model (two hops:
proxy -> ingress -> model), or, in the one-hop topology, the `LLMServer:<model>` deployment
serving the OpenAI routes itself (proxy -> model; `topology`, see `LLMServingArgs`).
`build_llm_deployment(config)` is the bare model deployment (for handles and batch jobs).

Each model replica gets a placement group: the config's bundles (one per tensor-parallel rank),
with the replica actor's own resources added to bundle 0, where Serve places the replica. The
defaults fit a 2-CPU node: a CPU rank reserves 1 CPU, the model replica itself and the ingress a
tenth of one each (the engine loop and the HTTP routing are light next to the model's compute).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from cluster.config import LLMConfig, LLMServingArgs, format_validation_error
from cluster.serve.ingress import OpenAiIngressDeployment
from cluster.serve.llm_server import LLMServer, rank_placement
from cluster.serve.one_hop import OpenAiServerDeployment
from cluster.serve.routing import resolve_request_router

DEFAULT_MODEL_OPTIONS: dict[str, Any] = {
    "max_ongoing_requests": 1_000_000_000,
    "health_check_period_s": 10,
    "health_check_timeout_s": 10,
    "graceful_shutdown_timeout_s": 60,
    "autoscaling_config": {"target_ongoing_requests": 1_000_000_000},
}
"""Ray Serve LLM's model defaults (plus a drain timeout): queueing is left to the engine, so
`max_ongoing_requests` and `target_ongoing_requests` are unlimited unless set. The autoscaling
default is merged key by key under the user's `autoscaling_config`, and dropped when the user
sets `num_replicas`."""
DEFAULT_INGRESS_OPTIONS: dict[str, Any] = {"max_ongoing_requests": 1_000_000_000}
INGRESS_NUM_CPUS = 0.1
"""CPUs the ingress replica asks for unless its ray_actor_options say otherwise."""
_REPLICA_DEFAULTS = {"num_cpus": 0.1}
_ACTOR_RESOURCE_KEYS = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def deployment_name(model_id: str) -> str:
    """`LLMServer:<model_id>` with '/' -> '--' and '.' -> '_' (Ray Serve LLM's naming)."""
    return "LLMServer:" + model_id.replace("/", "--").replace(".", "_")


def replica_bundles(config: LLMConfig, actor_options: dict[str, Any]) -> list[dict[str, float]]:
    """The replica's placement-group bundles, the replica's own resources added into bundle 0."""
    bundles = [dict(bundle) for bundle in rank_placement(config).bundles]
    first = bundles[0]
    for option, resource in _ACTOR_RESOURCE_KEYS.items():
        amount = actor_options.get(option, _REPLICA_DEFAULTS.get(option, 0))
        if amount:
            first[resource] = first.get(resource, 0.0) + float(amount)
    for resource, amount in (actor_options.get("resources") or {}).items():
        first[resource] = first.get(resource, 0.0) + float(amount)
    return bundles


def llm_deployment_options(
    config: LLMConfig, name_prefix: str | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The `serve.deployment` options of a model: defaults, its deployment_config, overrides."""
    options = with_model_defaults({**config.deployment_config, **(overrides or {})})
    options.setdefault("name", deployment_name(config.model_id))
    if options.get("request_router_config"):
        options["request_router_config"] = resolve_request_router(
            options["request_router_config"], config
        )
    if name_prefix:
        options["name"] = name_prefix + options["name"]
    actor_options = dict(options.get("ray_actor_options") or {})
    if config.runtime_env:
        actor_options["runtime_env"] = {
            **config.runtime_env,
            **actor_options.get("runtime_env", {}),
        }
    options["placement_group_bundles"] = replica_bundles(config, actor_options)
    options["placement_group_strategy"] = config.placement_strategy
    # The bundle reserves the replica's resources; the actor then asks for none of its own.
    actor_options.update({"num_cpus": 0, "num_gpus": 0})
    actor_options.pop("memory", None)
    actor_options.pop("resources", None)
    options["ray_actor_options"] = actor_options
    if "autoscaling_config" in options and options.get("num_replicas") != "auto":
        options.pop("num_replicas", None)
    return options


def with_model_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """`options` over `DEFAULT_MODEL_OPTIONS`, nested settings merged key by key (Ray Serve
    LLM's rule); a `num_replicas` drops the autoscaling default (a number: Serve refuses both;
    `auto`: Serve's own autoscaling defaults apply, as under Ray Serve LLM)."""
    defaults = dict(DEFAULT_MODEL_OPTIONS)
    if "num_replicas" in options:
        defaults.pop("autoscaling_config")
    merged = dict(defaults)
    for key, value in options.items():
        default = defaults.get(key)
        if isinstance(default, dict) and isinstance(value, dict):
            value = {**default, **value}
        merged[key] = value
    return merged


def build_llm_deployment(
    llm_config: LLMConfig | dict[str, Any],
    *,
    name_prefix: str | None = None,
    override_serve_options: dict[str, Any] | None = None,
) -> Application:
    """One model's `LLMServer` deployment, bound to its config."""
    config = LLMConfig.model_validate(llm_config)
    options = llm_deployment_options(config, name_prefix, override_serve_options)
    deployment: Any = serve.deployment(LLMServer)
    app: Application = deployment.options(**options).bind(config.model_dump())
    return app


def ingress_deployment_options(config: dict[str, Any]) -> dict[str, Any]:
    """The ingress's `serve.deployment` options: defaults (a tenth of a CPU), then `config`."""
    options = {"name": "OpenAiIngress", **DEFAULT_INGRESS_OPTIONS, **config}
    actor_options = dict(options.get("ray_actor_options") or {})
    actor_options.setdefault("num_cpus", INGRESS_NUM_CPUS)
    options["ray_actor_options"] = actor_options
    if "autoscaling_config" in options:
        options.pop("num_replicas", None)
    return options


def resource_summary(args: LLMServingArgs | dict[str, Any]) -> list[str]:
    """One line per deployment of `build_openai_app(args)`: what each replica reserves."""
    serving_args = LLMServingArgs.model_validate(args)
    lines = []
    for config in serving_args.llm_configs:
        options = llm_deployment_options(config)
        bundles = [_resources_text(bundle) for bundle in options["placement_group_bundles"]]
        lines.append(
            f"{options['name']}: each replica reserves a placement group "
            f"[{', '.join(bundles)}] ({options['placement_group_strategy']})"
        )
    if serving_args.uses_one_hop:
        return [line + "; it serves the OpenAI routes itself (one hop)" for line in lines]
    ingress = ingress_deployment_options(serving_args.ingress_deployment_config)
    num_cpus = ingress["ray_actor_options"]["num_cpus"]
    lines.append(f"{ingress['name']}: each replica asks for {{CPU: {num_cpus:g}}}")
    return lines


def _resources_text(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def build_openai_app(args: LLMServingArgs | dict[str, Any]) -> Application:
    """The OpenAI application: an ingress routing by `model` to one deployment per model."""
    try:
        serving_args = LLMServingArgs.model_validate(args)
    except ValidationError as error:
        raise ValueError(format_validation_error(error)) from None
    if serving_args.uses_one_hop:
        check_one_hop_router(serving_args)
        return build_one_hop_app(serving_args)
    servers = {config.model_id: build_llm_deployment(config) for config in serving_args.llm_configs}
    ingress_options = ingress_deployment_options(serving_args.ingress_deployment_config)
    ingress: Any = serve.deployment(OpenAiIngressDeployment)
    app: Application = ingress.options(**ingress_options).bind(servers)
    return app


def check_one_hop_router(serving_args: LLMServingArgs) -> None:
    """Under Serve's HAProxy ingress, HAProxy picks the one-hop model replica itself, so a
    request router there would never run: the two-hop topology keeps it (in the ingress)."""
    (config,) = serving_args.llm_configs
    if config.deployment_config.get("request_router_config") and haproxy_ingress():
        raise ValueError(
            "topology one_hop with a request_router_config: HAProxy (the haproxy ingress) "
            "would bypass the router; use topology two_hop (or auto), where the ingress runs it"
        )


def haproxy_ingress() -> bool:
    """Whether Serve's processes run the HAProxy ingress (`hybridserve serve --ingress`)."""
    return os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"


def build_one_hop_app(serving_args: LLMServingArgs) -> Application:
    """The one model's deployment serving the OpenAI routes itself; the ingress options give
    it only their environment variables (the API key)."""
    (config,) = serving_args.llm_configs
    options = llm_deployment_options(config)
    ingress_actor = serving_args.ingress_deployment_config.get("ray_actor_options") or {}
    ingress_env = (ingress_actor.get("runtime_env") or {}).get("env_vars") or {}
    if ingress_env:
        actor = options["ray_actor_options"]
        runtime_env = dict(actor.get("runtime_env") or {})
        runtime_env["env_vars"] = {**ingress_env, **(runtime_env.get("env_vars") or {})}
        actor["runtime_env"] = runtime_env
    deployment: Any = serve.deployment(OpenAiServerDeployment)
    app: Application = deployment.options(**options).bind(config.model_dump())
    return app

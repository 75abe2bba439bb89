"""`hybridserve serve`: run the OpenAI application on Ray Serve in the foreground.

    hybridserve serve                          the embedded default model (SmolLM2-135M-Instruct)
    hybridserve serve --model DIR [flags]      a local model folder with engine flags
    hybridserve serve --config FILE.yaml       a Serve config, an LLMServingArgs or an LLMConfig

It starts a local Ray instance (or joins `--address`), prints the URL and a ready line, and on
Ctrl-C (or SIGTERM) shuts Serve down, which drains the requests in flight, then exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
SERVICER = "cluster.serve.grpc.llm_pb2_grpc.add_LLMServiceServicer_to_server"


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve the OpenAI API on Ray Serve"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", help="Serve config, LLMServingArgs or LLMConfig YAML")
    source.add_argument("--model", help="local model folder (default: the embedded model)")
    parser.add_argument("--served-model-name", help="the name clients send as `model`")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=None, help="also serve gRPC here")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    parser.add_argument("--address", default="local", help="Ray address (default: new local)")
    parser.add_argument("--node-ip-address", default=None, help="this node's IP for Ray")
    parser.add_argument("--num-cpus", type=int, default=None)
    add_engine_arg_flags(parser, skip=("model",))
    return parser


def llm_config_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """An LLMConfig dict from `--model` and the engine flags (the default model when absent)."""
    engine_kwargs = engine_kwargs_from_args(args)
    if args.model is None:
        from worker.default_model import ensure_default_model

        source = str(ensure_default_model())
        model_id = args.served_model_name or DEFAULT_MODEL_ID
    else:
        source = args.model
        model_id = args.served_model_name or Path(args.model).name
    return {
        "model_loading_config": {"model_id": model_id, "model_source": source},
        "engine_kwargs": engine_kwargs,
    }


def applications(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """[(name, import_path, args, route_prefix) dicts], and the file's top-level Serve options."""
    if args.config is None:
        llm_args = {"llm_configs": [llm_config_from_flags(args)]}
        return [{"name": "llm", "args": llm_args}], {}
    from cluster.config.llm_config import load_yaml_mapping

    data = load_yaml_mapping(args.config)
    if "applications" in data:
        return list(data["applications"]), data
    if "llm_configs" in data:
        return [{"name": "llm", "args": data}], {}
    return [{"name": "llm", "args": {"llm_configs": [data]}}], {}


def _with_api_key(app_args: dict[str, Any], api_key: str | None) -> dict[str, Any]:
    if api_key is None:
        return app_args
    from cluster.serve.ingress import API_KEY_ENV

    ingress = dict(app_args.get("ingress_deployment_config") or {})
    actor = dict(ingress.get("ray_actor_options") or {})
    env = dict(actor.get("runtime_env") or {})
    env["env_vars"] = {**env.get("env_vars", {}), API_KEY_ENV: api_key}
    actor["runtime_env"] = env
    ingress["ray_actor_options"] = actor
    return {**app_args, "ingress_deployment_config": ingress}


def _builder(import_path: str) -> Any:
    module, _, attr = import_path.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _start(args: argparse.Namespace, file_options: dict[str, Any]) -> None:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions

    init: dict[str, Any] = {"address": args.address, "include_dashboard": False}
    if args.node_ip_address:
        init["_node_ip_address"] = args.node_ip_address
    if args.num_cpus:
        init["num_cpus"] = args.num_cpus
    ray.init(**init)
    http = file_options.get("http_options") or {"host": args.host, "port": args.port}
    grpc_options = file_options.get("grpc_options")
    if args.grpc_port is not None:
        grpc_options = {"port": args.grpc_port, "grpc_servicer_functions": [SERVICER]}
    kwargs: dict[str, Any] = {"http_options": HTTPOptions(**http)}
    if grpc_options:
        kwargs["grpc_options"] = gRPCOptions(**grpc_options)
    serve.start(**kwargs)


def run_serve(args: argparse.Namespace) -> int:
    """Deploy, print the URL and a ready line, block until Ctrl-C or SIGTERM, drain, exit."""
    from ray import serve

    apps, file_options = applications(args)
    _start(args, file_options)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        for app in apps:
            builder = _builder(app.get("import_path", "cluster.serve:build_openai_app"))
            built = builder(_with_api_key(dict(app.get("args") or {}), args.api_key))
            route = app.get("route_prefix", "/")
            serve.run(built, name=app.get("name", "llm"), route_prefix=route)
        http = file_options.get("http_options") or {"host": args.host, "port": args.port}
        url = f"http://{http.get('host', '127.0.0.1')}:{http.get('port', 8000)}/v1"
        sys.stdout.write(f"hybridserve: OpenAI API at {url}\n")
        sys.stdout.write("hybridserve: ready (Ctrl-C to stop)\n")
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.stdout.write("hybridserve: shutting down (draining requests in flight)\n")
        sys.stdout.flush()
        _shutdown()
    return 0


def _shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()  # type: ignore[no-untyped-call]
    finally:
        ray.shutdown()

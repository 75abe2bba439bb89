"""`hybridserve serve`: run the OpenAI application on Ray Serve in the foreground.

    hybridserve serve                          the embedded default model (SmolLM2-135M-Instruct)
    hybridserve serve --model DIR [flags]      a local model folder with engine flags
    hybridserve serve --config FILE.yaml       a Serve config, an LLMServingArgs or an LLMConfig
    hybridserve serve --ingress proxy          Serve's Python proxy instead of HAProxy

It joins the cluster `--address` or RAY_ADDRESS names (or the one `ray start` runs on this
machine), else starts a local Ray instance; deploys; waits until the applications run, or fails
with one line when a replica cannot be placed within `--placement-timeout-s` (exit 2); prints
the URL and a ready line. Ctrl-C or SIGTERM stops it at any moment: once ready, the requests in
flight drain first (exit 0); during start-up it stops at once (exit 130). It deletes what it
deployed and stops the Ray instance it started, leaving no process behind.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cluster.cli.ingress_mode import AUTO, INGRESS_MODES
from cluster.cli.serve_apps import PD_IMPORT_PATH, say
from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
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
    parser.add_argument(
        "--ingress",
        choices=INGRESS_MODES,
        default=AUTO,
        help="HTTP ingress: haproxy (HAProxy straight to the replicas), proxy (Serve's Python "
        "proxy) or auto (haproxy where its binary is found; default)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster: host:port, auto or local (default: RAY_ADDRESS, else the cluster "
        "`ray start` runs here, else a new local instance)",
    )
    parser.add_argument("--node-ip-address", default=None, help="a new local instance's IP")
    parser.add_argument("--num-cpus", type=int, default=None, help="a new local instance's CPUs")
    parser.add_argument(
        "--stream-batching-interval-ms",
        type=float,
        default=None,
        help="how long a stream holds its tokens before sending them (default: adapt to the "
        "load; 0: every step's tokens at once); with --config, set "
        "experimental_configs.stream_batching_interval_ms in the file",
    )
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
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": model_id, "model_source": source},
        "engine_kwargs": engine_kwargs,
    }
    if args.stream_batching_interval_ms is not None:
        interval = {"stream_batching_interval_ms": args.stream_batching_interval_ms}
        config["experimental_configs"] = interval
    return config


def applications(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """[(name, import_path, args, route_prefix) dicts], and the file's top-level Serve options."""
    if args.config is not None and args.stream_batching_interval_ms is not None:
        raise ValueError(
            "--stream-batching-interval-ms goes with --model; with --config set "
            "experimental_configs.stream_batching_interval_ms in the file"
        )
    if args.config is None:
        llm_args = {"llm_configs": [llm_config_from_flags(args)]}
        return [{"name": "llm", "args": llm_args}], {}
    from cluster.config.llm_config import load_yaml_mapping

    data = load_yaml_mapping(args.config)
    if "applications" in data:
        return list(data["applications"]), data
    if "llm_configs" in data:
        return [{"name": "llm", "args": data}], {}
    if "prefill_config" in data or "decode_config" in data:
        return [{"name": "llm", "import_path": PD_IMPORT_PATH, "args": data}], {}
    return [{"name": "llm", "args": {"llm_configs": [data]}}], {}


def run(args: argparse.Namespace) -> int:
    """Deploy, print the URL and a ready line, block until Ctrl-C or SIGTERM, stop, exit."""
    from cluster.cli.serve_session import ServeSession, interrupts_raise

    apps, file_options = applications(args)
    with interrupts_raise():
        session = ServeSession(args, file_options)
        try:
            session.start(apps)
            say(f"OpenAI API at {session.url}")
            say("ready (Ctrl-C to stop)")
            session.wait_forever()
        except KeyboardInterrupt:
            return session.stop_interrupted()
        finally:
            session.stop()
    return 0

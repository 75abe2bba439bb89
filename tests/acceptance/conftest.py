"""Fixtures of the README acceptance tests: the environment a user's shell gives a command.

Nothing is pre-started and no resource is hand-picked. The only changes from a user's shell:
Ray's node is pinned to a loopback address (by the tests' flags), and Ray's temp dir is a fresh
one, so a cluster that another test (or program) left recorded on this machine is not joined.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.ray_local import NODE_IP

HYBRIDSERVE = str(Path(sys.executable).parent / "hybridserve")


@pytest.fixture
def user_env() -> Iterator[dict[str, str]]:
    """A shell's environment with no RAY_* settings and a fresh Ray temp dir (short: Ray puts
    Unix sockets under it)."""
    ray_tmp = tempfile.mkdtemp(prefix="hs-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = ray_tmp
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    yield env
    shutil.rmtree(ray_tmp, ignore_errors=True)


def serve_port() -> int:
    """8000, the README's port, unless something on this machine already holds it."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", 8000))
            return 8000
        except OSError:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])


def serve_command(*flags: str) -> list[str]:
    """`hybridserve serve` (what `make serve` runs) with Ray pinned to loopback."""
    return [HYBRIDSERVE, "serve", "--node-ip-address", NODE_IP, *flags]

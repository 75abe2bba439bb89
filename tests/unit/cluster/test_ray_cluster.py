"""How entry points find the Ray cluster (`cluster.ray_cluster.find_cluster`), with no cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.ray_cluster import ClusterConnectionError, connect, find_cluster


@pytest.fixture(autouse=True)
def ray_temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Ray temp dir of the test's own, and no RAY_ADDRESS."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray"


def test_an_address_given_wins_over_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert find_cluster("10.0.0.2:6379").address == "10.0.0.2:6379"
    assert find_cluster(None).address == "10.0.0.1:6379"
    assert find_cluster(None).origin == "RAY_ADDRESS"
    assert find_cluster("local").is_new_instance


def test_nothing_named_or_running_starts_a_new_instance() -> None:
    assert find_cluster(None).is_new_instance


def test_a_recorded_cluster_that_no_longer_runs_is_not_joined(ray_temp_dir: Path) -> None:
    (ray_temp_dir / "ray_current_cluster").write_text("127.0.0.9:1")
    assert find_cluster(None).is_new_instance
    with pytest.raises(ClusterConnectionError, match="no running Ray cluster"):
        find_cluster("auto")


def test_an_unreachable_address_fails_at_once_naming_it() -> None:
    with pytest.raises(ClusterConnectionError, match=r"at 127\.0\.0\.9:1 \(--address\)"):
        connect("127.0.0.9:1")


CTRL_C_WHILE_STARTING = """
import os, signal, subprocess, sys, time
from cluster.ray_cluster import _ctrl_c_held
with _ctrl_c_held():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C while the processes start
    time.sleep(20)  # Ray still starting
"""


def test_ctrl_c_while_ray_starts_kills_what_started_and_exits_130_at_once() -> None:
    """The watcher takes a Ctrl-C held back during the start: the processes started so far die
    and the process exits 130 at once, not when the start is over."""
    import os
    import subprocess
    import sys
    import time

    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_WHILE_STARTING],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert result.returncode == 130, result.stderr
    assert time.monotonic() - started < 15
    assert "interrupted while Ray was starting" in result.stderr
    child = int(result.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)

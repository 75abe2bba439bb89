"""Finding the cluster as Ray's own tools do: `hybridserve serve` joins the cluster RAY_ADDRESS
names, or the one `ray start --head` runs on this machine, with its token authentication; an
unreachable address or a deployment that cannot be placed ends in one line, in seconds.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.acceptance.conftest import serve_command, serve_port
from tests.helpers.cli_process import CliProcess
from tests.helpers.ray_head import ray_head
from tests.helpers.ray_local import NODE_IP
from tests.helpers.serve_app import save_tiny_served_model

pytestmark = pytest.mark.ray


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((NODE_IP, 0))
        return int(sock.getsockname()[1])


def _last_line(cli: CliProcess) -> str:
    return [line for line in cli.lines if line.strip()][-1]


def test_an_unreachable_address_fails_in_seconds_with_one_line(user_env: dict[str, str]) -> None:
    address = f"{NODE_IP}:{_closed_port()}"
    cli = CliProcess(serve_command("--address", address), user_env)
    try:
        code, _seconds = cli.wait_exit(20)
        assert code == 2, cli.output()
        line = _last_line(cli)
        assert line.startswith("hybridserve serve: error: cannot connect to the Ray cluster at")
        assert address in line
        assert "--address" in line
        assert "Traceback" not in cli.output()
    finally:
        cli.close()


def test_llm_on_an_unreachable_address_fails_in_seconds(user_env: dict[str, str]) -> None:
    address = f"{NODE_IP}:{_closed_port()}"
    script = f"from cluster import LLM\nLLM(address={address!r})\n"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script], env=user_env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 30
    assert f"cannot connect to the Ray cluster at {address}" in result.stderr.splitlines()[-1]


def _chat(port: int) -> str:
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "t1 t2"}],
            "max_tokens": 3,
        }
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return str(json.load(reply)["choices"][0]["finish_reason"])


@pytest.mark.parametrize("found_by", ["RAY_ADDRESS", "ray start"])
def test_serve_joins_a_ray_start_cluster_with_its_token(
    user_env: dict[str, str], tmp_path: Path, found_by: str
) -> None:
    model = save_tiny_served_model(tmp_path / "tiny")
    port = serve_port()
    ray_temp_dir = str(Path(user_env["RAY_TMPDIR"]) / "ray")  # where `ray start` records it
    with ray_head(tmp_path, temp_dir=ray_temp_dir) as head:
        env = {**user_env, "RAY_AUTH_TOKEN_PATH": head.client_env["RAY_AUTH_TOKEN_PATH"]}
        if found_by == "RAY_ADDRESS":
            env["RAY_ADDRESS"] = head.address
        cli = CliProcess(serve_command("--model", str(model), "--port", str(port)), env)
        try:
            cli.wait_for_line("hybridserve: ready", 240)
            assert f"hybridserve: Ray: {head.address}" in cli.output()
            assert _chat(port) in ("length", "stop")
            cli.ctrl_c()
            code, _ = cli.wait_exit(30)
            assert code == 0, cli.output()
            assert cli.alive_processes() == [], cli.output()
        finally:
            cli.close()
        assert "InvalidAuthToken" not in cli.output()


def test_replicas_that_cannot_be_placed_end_in_one_line(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    model = save_tiny_served_model(tmp_path / "tiny")
    flags = ("--model", str(model), "--tensor-parallel-size", "64", "--placement-timeout-s", "5")
    cli = CliProcess(serve_command(*flags, "--port", str(serve_port())), user_env)
    try:
        code, _ = cli.wait_exit(90)
        assert code == 2, cli.output()
        line = _last_line(cli)
        assert line.startswith("hybridserve serve: error: replicas could not be placed within 5 s")
        assert "1 of LLMServer:tiny" in line
        assert "the cluster has {CPU: " in line
        assert cli.alive_processes() == [], cli.output()
    finally:
        cli.close()

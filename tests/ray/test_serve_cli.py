"""`hybridserve serve` end to end: ready line, a request with the `openai` client, Ctrl-C.

Slow (it starts its own Ray instance and Serve in a subprocess), so not in the default run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.helpers.ray_local import NODE_IP, REPO_ROOT
from tests.helpers.serve_app import free_port, save_tiny_served_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_serve_command_serves_until_interrupted(tmp_path: Path) -> None:
    model_dir = save_tiny_served_model(tmp_path / "tiny")
    port = free_port()
    command = [
        sys.executable, "-m", "cluster.cli", "serve", "--model", str(model_dir),
        "--distributed-executor-backend", "uni", "--block-size", "4",
        "--node-ip-address", NODE_IP, "--host", NODE_IP, "--port", str(port), "--num-cpus", "4",
        "--api-key", "sk-cli",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        assert process.stdout is not None
        lines = []
        deadline = time.monotonic() + 240
        while not any("ready" in line for line in lines):
            assert time.monotonic() < deadline, lines
            assert process.poll() is None, lines
            lines.append(process.stdout.readline())
        assert f"http://{NODE_IP}:{port}/v1" in "".join(lines)
        client = openai.OpenAI(base_url=f"http://{NODE_IP}:{port}/v1", api_key="sk-cli")
        reply = client.completions.create(model="tiny", prompt="t1 t2", max_tokens=3)
        assert reply.choices[0].finish_reason == "length"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
    finally:
        if process.poll() is None:  # SIGTERM also stops its Ray instance; kill only if stuck
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

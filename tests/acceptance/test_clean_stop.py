"""Every entry point stops promptly on Ctrl-C and SIGTERM in the middle of its work, leaving no
Ray, rank or worker process behind: a batch run, and offline `LLM` scripts on the
multi-process (TP = 2) and Ray executors.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.acceptance.conftest import HYBRIDSERVE
from tests.helpers.cli_process import TIMEOUT_EXIT_CODE, CliProcess
from tests.helpers.ray_local import NODE_IP
from tests.helpers.serve_app import save_tiny_served_model

pytestmark = pytest.mark.ray

STOP_TIMEOUT_S = 30.0
"""Generous for a loaded 2-core machine: the ranks finish the step they are in, then leave."""
LLM_SCRIPT = """
import ray
from cluster import LLM, SamplingParams

if __name__ == "__main__":  # the mp executor spawns its rank processes
    if {backend!r} == "ray":
        ray.init(_node_ip_address={node_ip!r})
    llm = LLM({model!r}, distributed_executor_backend={backend!r}, tensor_parallel_size={tp})
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    print("generating", flush=True)
    while True:
        llm.generate([[1, 2, 3]] * 8, params, use_tqdm=False)
"""


def _stop_and_check(cli: CliProcess, stop: str) -> None:
    getattr(cli, stop)()
    code, _ = cli.wait_exit(STOP_TIMEOUT_S)
    still_running = f"still running {STOP_TIMEOUT_S:g} s after {stop}"
    assert code != TIMEOUT_EXIT_CODE, f"{still_running}:\n{cli.output()}"
    assert cli.alive_processes() == [], cli.output()


@pytest.mark.parametrize(("backend", "tp", "stop"), [("mp", 2, "ctrl_c"), ("ray", 1, "terminate")])
def test_an_llm_script_stops_mid_generate(
    user_env: dict[str, str], tmp_path: Path, backend: str, tp: int, stop: str
) -> None:
    model = save_tiny_served_model(tmp_path / "tiny")
    script = LLM_SCRIPT.format(backend=backend, tp=tp, model=str(model), node_ip=NODE_IP)
    (tmp_path / "script.py").write_text(script)
    cli = CliProcess([sys.executable, str(tmp_path / "script.py")], user_env, cwd=tmp_path)
    try:
        cli.wait_for_line("generating", 240)
        _stop_and_check(cli, stop)
    finally:
        cli.close()


def test_a_batch_run_stops_on_sigterm(user_env: dict[str, str], tmp_path: Path) -> None:
    model = save_tiny_served_model(tmp_path / "tiny")
    rows = [
        {"id": f"r{index}", "prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 400}}
        for index in range(200)
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    command = [
        HYBRIDSERVE, "batch", "--input", str(source), "--output", str(tmp_path / "out.jsonl"),
        "--model", str(model),
    ]  # fmt: skip
    cli = CliProcess(command, user_env, cwd=tmp_path)
    try:
        cli.wait_for_line("Started a local Ray instance", 120)
        time.sleep(10)  # the replica pool starts and takes its first rows
        _stop_and_check(cli, "terminate")
    finally:
        cli.close()

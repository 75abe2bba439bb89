"""The README's Python example on Ray (`distributed_executor_backend="ray"`), run as a script that
never calls `shutdown()`: it prints its answer and exits by itself within 10 s of its last line,
leaving no process behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.cli_process import CliProcess
from tests.helpers.ray_local import NODE_IP
from tests.helpers.readme import README, code_block

pytestmark = pytest.mark.ray

LAST_LINE = 'print("script: done", flush=True)\n'


def test_the_readme_ray_script_exits_by_itself(user_env: dict[str, str], tmp_path: Path) -> None:
    source = code_block('distributed_executor_backend="ray"', "python", README)
    assert "shutdown()" not in source
    pinned = source.replace("ray.init()", f"ray.init(_node_ip_address={NODE_IP!r})")
    assert pinned != source
    script = tmp_path / "on_ray.py"
    script.write_text(pinned + LAST_LINE)
    cli = CliProcess([sys.executable, str(script)], user_env, cwd=tmp_path)
    try:
        cli.wait_for_line("script: done", 300)
        code, seconds = cli.wait_exit(10)
        assert code == 0, f"exit {code} after {seconds:.1f} s:\n{cli.output()}"
        assert any("Paris" in line for line in cli.lines), cli.output()
        assert cli.alive_processes() == [], cli.output()
    finally:
        cli.close()

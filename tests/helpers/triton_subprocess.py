"""Running Triton kernel checks in a fresh Python: the interpreter (`TRITON_INTERPRET=1`) must be
set before `triton` is imported, so each check runs `prelude + code` in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(prelude: str, code: str, timeout: float = 180.0) -> None:
    """Run `prelude + code` with TRITON_INTERPRET=1; fail with the process's stderr."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"

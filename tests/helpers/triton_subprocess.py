"""Running Triton kernel checks in a fresh Python: the interpreter (`TRITON_INTERPRET=1`) must be
set before `triton` is imported, and compiling for a GPU target must run without it, so each
check runs `prelude + code` in its own process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(prelude: str, code: str, timeout: float = 180.0) -> None:
    """Run `prelude + code` with TRITON_INTERPRET=1; fail with the process's stderr."""
    _run(prelude, code, {**os.environ, "TRITON_INTERPRET": "1"}, timeout)


def run_compiling(prelude: str, code: str, cache_dir: Path, timeout: float = 300.0) -> None:
    """Run `prelude + code` without the interpreter, Triton's cache in `cache_dir`."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    _run(prelude, code, {**env, "TRITON_CACHE_DIR": str(cache_dir)}, timeout)


def _run(prelude: str, code: str, env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=REPO_ROOT,
        env={**env, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"

"""Every `hybridserve` subcommand module loads without Ray: the command sets up Ray's token before
Ray is imported, and a module that pulls Ray in at load time breaks every command's start-up."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import cluster.cli


def _subcommand_modules() -> list[str]:
    return [
        f"cluster.cli.{info.name}"
        for info in pkgutil.iter_modules(cluster.cli.__path__)
        if info.name != "__main__"
    ]


def test_no_subcommand_module_imports_ray_when_loaded() -> None:
    modules = _subcommand_modules()
    assert "cluster.cli.batch" in modules
    script = (
        "import importlib, sys\n"
        + "".join(f"importlib.import_module({name!r})\n" for name in modules)
        + "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout[-2000:]

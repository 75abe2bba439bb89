"""The scheduler package stays pure Python: importing all of it loads neither torch nor ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import importlib, json, pkgutil, sys
import scheduler
names = sorted(m.name for m in pkgutil.walk_packages(scheduler.__path__, "scheduler."))
for name in names:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "ray"})
print(json.dumps({"modules": names, "heavy": heavy}))
"""


def test_importing_every_scheduler_module_loads_no_torch_or_ray() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, check=True
    )
    report = json.loads(result.stdout)
    assert "scheduler.kv_cache.manager" in report["modules"]
    assert "scheduler.replay" in report["modules"]
    assert report["heavy"] == []

"""Repository hygiene: file-size cap, module docstrings, and the package import rules.

The run-time check that importing scheduler/ loads neither torch nor ray is in
tests/unit/scheduler/test_scheduler_purity.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler", "worker", "kernels", "cluster")
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_module_is_small_and_documented(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_LINES, f"{path} exceeds {MAX_LINES} lines"
    assert ast.get_docstring(ast.parse(text)), f"{path} has no module docstring"


def _imported_top_levels(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


FORBIDDEN = {
    "scheduler": {"torch", "ray", "worker", "kernels", "cluster", "numpy"},
    "kernels": {"ray", "scheduler", "worker", "cluster"},
    "worker": {"ray", "cluster"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_import_rules(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(_imported_top_levels(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert not {k: v for k, v in offenders.items() if v}

"""Repository hygiene, run by `make lint` (not a test: one pass/fail for the whole tree).

Every module of the four packages has a module docstring and at most 500 lines. The import
rules between packages are import-linter's contracts (pyproject.toml), and the run-time check
that importing scheduler/ loads neither torch nor ray is a unit test of the scheduler.

    python tests/lint/check_hygiene.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler", "worker", "kernels", "cluster")
MAX_LINES = 500


def problems() -> list[str]:
    """One line per module that is too long or has no docstring."""
    found = []
    for path in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        num_lines = len(text.splitlines())
        if num_lines > MAX_LINES:
            found.append(f"{name}: {num_lines} lines, more than {MAX_LINES}")
        if not ast.get_docstring(ast.parse(text)):
            found.append(f"{name}: no module docstring")
    return found


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

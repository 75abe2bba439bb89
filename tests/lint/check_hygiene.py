"""Repository hygiene, run by `make lint` (not a test: one pass/fail for the whole tree).

Every module of the four packages has a module docstring and at most 500 lines, and no modules
of the four packages or of benchmarks/ import each other in a circle (imports inside functions
and `if TYPE_CHECKING:` count too: a deferred import only hides a circle). The import rules
between packages are import-linter's contracts (pyproject.toml), and the run-time check that
importing scheduler/ loads neither torch nor ray is a unit test of the scheduler.

    python tests/lint/check_hygiene.py
"""

from __future__ import annotations

import ast
import graphlib
import sys
from collections.abc import Iterator, Set
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler", "worker", "kernels", "cluster")
MAX_LINES = 500
CYCLE_ROOTS = (*PACKAGES, "benchmarks")
"""Folders whose modules must not import each other in a circle (benchmarks/: the scripts too,
which import their neighbours by bare name)."""


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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _named(node: ast.Import | ast.ImportFrom, package: str, modules: Set[str]) -> list[str]:
    """What one import statement names: `import a.b` a.b; `from a import b` a.b where that is
    a module, else a; a relative `from` resolved against `package`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parent = parts[: len(parts) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
    full = [f"{base}.{alias.name}" for alias in node.names]
    return [name if name in modules else base for name in full]


def imported_modules(path: Path, modules: Set[str]) -> Iterator[str]:
    """The modules among `modules` that the file's import statements name, at any depth (a
    bare name a script of the same folder tree imports, `bench_x`, is `benchmarks.bench_x`)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    root = module.partition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for name in _named(node, package, modules):
            found = name if name in modules else f"{root}.{name}"
            if found in modules and found != module:
                yield found


def import_cycle() -> list[str]:
    """One circle of module imports (first module repeated at the end), or []."""
    paths = {module_name(p): p for root in CYCLE_ROOTS for p in (ROOT / root).rglob("*.py")}
    graph = {name: set(imported_modules(path, paths.keys())) for name, path in paths.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def main() -> int:
    found = problems()
    cycle = import_cycle()
    if cycle:
        found.append(f"import circle: {' -> '.join(cycle)}")
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

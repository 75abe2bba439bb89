"""How pytest-xdist hands out the tests (a plugin: `-p tests.helpers.xdist_groups` in the
pytest options), in groups that each run on one worker:

- every test that starts Ray (they live in `RAY_TEST_DIRS`), one after another: two Ray clusters
  at once would each have half of a 2-core machine for start-ups timed for a whole one;
- the modules built on the embedded default model (converted and read once per worker);
- every other module on its own (its module fixtures are built once).

The grouping goes by node ID, which is all xdist's scheduler sees; a Ray test outside
`RAY_TEST_DIRS` is refused at collection.
"""

from __future__ import annotations

from typing import Any

import pytest

RAY_TEST_DIRS = ("tests/ray/", "tests/acceptance/", "tests/multinode/")
DEFAULT_MODEL_MODULES = frozenset(
    {
        "tests/parity/test_llm_generate.py",
        "tests/parity/test_vllm_script.py",
        "tests/parity/test_structured_default_model.py",
        "tests/unit/worker/test_default_model.py",
        "tests/unit/cluster/test_detokenizer.py",
    }
)


def group_of(nodeid: str) -> str:
    """The group a test runs in."""
    module = nodeid.split("::")[0]
    if module.startswith(RAY_TEST_DIRS):
        return "ray"
    return "default-model" if module in DEFAULT_MODEL_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's per-scope scheduling with `group_of` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    strays = [item.nodeid for item in items if _starts_ray(item) and group_of(item.nodeid) != "ray"]
    if strays:
        raise pytest.UsageError(f"tests that start Ray belong under {RAY_TEST_DIRS}: {strays[:3]}")


def _starts_ray(item: pytest.Item) -> bool:
    return item.get_closest_marker("ray") is not None

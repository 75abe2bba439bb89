"""How pytest-xdist hands out the tests (a plugin: `-p tests.helpers.xdist_groups` in the
pytest options): by module, each module's tests on one worker (its module fixtures are built
once), and the modules built on the embedded default model together (it is converted and read
once). The grouping goes by node ID, which is all xdist's scheduler sees.
"""

from __future__ import annotations

from typing import Any

import pytest

DEFAULT_MODEL_MODULES = frozenset(  # checked by tests/unit/test_xdist_groups.py
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
    return "default-model" if module in DEFAULT_MODEL_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's per-scope scheduling with `group_of` as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)

"""Fixtures of the Ray tests: one local loopback Ray instance for the tests of this folder.

Modules share the instance while they declare the same CPUs. Ray is stopped after the last test
here (not at the end of the session): while the test process is a Ray driver, `EngineArgs` picks
the `ray` executor by default, which later in-process tests must not get.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from tests.helpers.ray_local import start_local_ray, stop_local_ray
from tests.ray.batch_cases import BatchModel, make_batch_model

RAY_TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> None:
    """A local Ray instance on 127.0.0.2 declaring the machine's CPUs, or the module's
    `RAY_CPUS` where it states why it needs more (Ray restarts when the count changes; it is
    stopped after this folder's tests)."""
    start_local_ray(getattr(request.module, "RAY_CPUS", None))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """This folder's modules run grouped by the CPUs they declare (file order within a group),
    so Ray restarts once per count instead of at every change."""
    slots = [
        i for i, item in enumerate(items) if Path(item.path).resolve().is_relative_to(RAY_TESTS)
    ]
    ordered = sorted((items[i] for i in slots), key=_module_cpus)
    for slot, item in zip(slots, ordered, strict=True):
        items[slot] = item


def _module_cpus(item: pytest.Item) -> int:
    return int(getattr(item.module, "RAY_CPUS", 0)) if isinstance(item, pytest.Function) else 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    yield  # the module fixtures (engines) are torn down first
    if nextitem is None or not Path(nextitem.path).resolve().is_relative_to(RAY_TESTS):
        stop_local_ray()


@pytest.fixture(scope="session")
def batch_model(tmp_path_factory: pytest.TempPathFactory) -> BatchModel:
    """The batch tests' tiny model and the tokens `LLM.generate` gives for their rows."""
    return make_batch_model(tmp_path_factory.mktemp("batch-model"))

"""Fixtures of the Ray tests: one loopback Ray instance per session (tests/helpers/ray_local.py)."""

from __future__ import annotations

import pytest

from tests.helpers.ray_local import start_local_ray, stop_local_ray
from tests.ray.batch_cases import BatchModel, make_batch_model


@pytest.fixture(scope="session")
def ray_cluster():
    start_local_ray()
    yield
    stop_local_ray()


@pytest.fixture(scope="session")
def batch_model(tmp_path_factory: pytest.TempPathFactory) -> BatchModel:
    """The batch tests' tiny model and the tokens `LLM.generate` gives for their rows."""
    return make_batch_model(tmp_path_factory.mktemp("batch-model"))

"""Fixtures of the Ray tests: one loopback Ray instance per session (tests/helpers/ray_local.py)."""

from __future__ import annotations

import pytest

from tests.helpers.ray_local import start_local_ray, stop_local_ray


@pytest.fixture(scope="session")
def ray_cluster():
    start_local_ray()
    yield
    stop_local_ray()

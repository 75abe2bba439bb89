"""Fixtures of the Ray tests: one local loopback Ray instance for the whole session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.ray_local import start_local_ray, stop_local_ray


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray instance on 127.0.0.2 (started once, stopped at the end of the session)."""
    start_local_ray()
    yield
    stop_local_ray()

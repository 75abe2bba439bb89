"""Polling for a condition that another process makes true (a replica's stats reaching a router,
an actor going away): the test goes on as soon as it holds, and fails with what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.05


def wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """The condition's first truthy value; AssertionError naming `what` past the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"{what} within {timeout_s} s")

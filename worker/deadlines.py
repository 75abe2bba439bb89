"""Time left before a deadline (a `time.monotonic()` value), for the waits that take a timeout.

The one home of that expression for the direct KV sends here and for `cluster/` (KV transfers,
the peer pull, the rank executors and their transport); plain Python, so the rank transport may
import it without loading torch.

`seconds_left` suits waits where 0 means "do not wait" (a process join, `ray.get`, a poll);
`timeout_until` suits those that read 0 otherwise (a socket's 0 is non-blocking): a deadline
already passed gives the shortest positive timeout, so the wait times out at once.
"""

from __future__ import annotations

import time

MIN_TIMEOUT_S = 0.001
"""The shortest timeout `timeout_until` gives."""


def seconds_left(deadline: float) -> float:
    """Seconds from now until `deadline`; 0 once it passed."""
    return max(0.0, deadline - time.monotonic())


def timeout_until(deadline: float) -> float:
    """A timeout that ends at `deadline`: the seconds left, at least `MIN_TIMEOUT_S`."""
    return max(deadline - time.monotonic(), MIN_TIMEOUT_S)

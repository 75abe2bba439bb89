"""Compiled constraints, bounded, compiled in a background thread.

`get` returns a future per distinct (backend, constraint): the first caller submits the compile
to the compile thread, later callers share its future, and the least recently used entry leaves
once `capacity` is exceeded. Invalid constraints are refused by the backend's cheap `parse`
before anything is queued, so their error reaches the caller at once.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_CAPACITY = 256


class CompileCache:
    """Futures of compiled constraints (thread-safe: callers may prepare from any thread)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[Hashable, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self.num_compiles = 0

    def get(self, key: Hashable, parse: Callable[[], Callable[[], Any]]) -> Future[Any]:
        """The compile of `key`: on a miss `parse()` runs here (raising ValueError for an invalid
        constraint) and the compile it returns runs in the compile thread."""
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                return future
            compile_now = parse()
            future = self._pool.submit(compile_now)
            self._entries[key] = future
            self.num_compiles += 1
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            return future

    def __len__(self) -> int:
        return len(self._entries)

"""Copies of adapters into device slots off the step loop: one background thread (and, on CUDA,
a side stream), one pending copy per adapter name.

The manager decides every slot on its own thread; a copy only writes the slot it was given,
which no step reads until `wait` has returned for that adapter (and, on CUDA, the step's stream
waits for the copy's event).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class SlotLoads:
    """Pending slot copies by adapter name."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-slot-load")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self._pending: dict[str, Future[torch.cuda.Event | None]] = {}

    def start(self, name: str, copy: Callable[[], None]) -> None:
        """Run `copy` (writes `name`'s slot) in the background."""
        assert name not in self._pending, f"adapter {name!r} is already being copied"
        steps_done: torch.cuda.Event | None = None
        if self._stream is not None:  # the slot's old adapter may still be read by queued steps
            steps_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            steps_done.record(torch.cuda.current_stream(self.device))
        self._pending[name] = self._executor.submit(self._run, copy, steps_done)

    def is_pending(self, name: str) -> bool:
        """Whether `name` has a copy that `wait` has not collected yet."""
        return name in self._pending

    def wait(self, name: str) -> None:
        """Return once `name`'s copy (if any) is done and visible to the current stream;
        re-raises the copy's error."""
        future = self._pending.pop(name, None)
        if future is None:
            return
        event = future.result()
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @torch.inference_mode()
    def _run(
        self, copy: Callable[[], None], steps_done: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        # Inference mode is per thread: slots created inside a step are inference tensors,
        # which only inference mode may write.
        if self._stream is None:
            copy()
            return None
        assert steps_done is not None
        self._stream.wait_event(steps_done)
        with torch.cuda.stream(self._stream):
            copy()
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return event

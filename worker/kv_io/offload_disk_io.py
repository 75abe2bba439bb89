"""The offload tier's background work, off the step: one thread writes, reads and deletes block
files in the order the steps asked (so a file is read or deleted only after it was written);
another copies in-memory pages into the pool (CPU loads), so neither stalls the step.

A load job reads its request's pages (from files, or as they are in memory) and, when given an
`apply`, writes them into the pool itself. `LoadJob.cancel` (its request left, or its time ran
out) takes the job's lock, so once it returns the job never touches the pool: the pool's blocks
may be reused at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from scheduler.output import OffloadLoad
from worker.kv_io.block_export import BlockPages
from worker.kv_io.offload_disk import BlockFileError, read_block_file, write_block_file

logger = logging.getLogger(__name__)

LoadedPages = list[tuple[OffloadLoad, BlockPages]]
"""A request's loads with the pages each one writes into its block."""

ApplyPages = Callable[[LoadedPages], None]
"""Writes a request's loaded pages into the pool."""

LOAD_ERRORS = (AssertionError, BlockFileError, KeyError, OSError, RuntimeError)
"""What a failed load raises (a missing slot or file, a file that fails its checks, ...)."""


class LoadJob:
    """One request's loads on a background thread."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self.started = time.perf_counter()
        self.future: Future[LoadedPages] | None = None
        self._lock = threading.Lock()
        self._cancelled = False

    def run(
        self, loads: list[tuple[OffloadLoad, BlockPages | None]], apply: ApplyPages | None
    ) -> LoadedPages:
        loaded = _read_all(loads)
        if apply is not None:
            with self._lock:
                if self._cancelled:
                    return loaded
                with torch.inference_mode():
                    apply(loaded)
        return loaded

    def cancel(self) -> None:
        """From now on the job never writes the pool (waits for a write under way)."""
        with self._lock:
            self._cancelled = True

    def result(self) -> LoadedPages | None:
        """The pages once the job ended (None while it runs); raises what the job raised."""
        assert self.future is not None
        return self.future.result() if self.future.done() else None


class DiskIO:
    """Block-file writes, reads and deletes on one thread, in submission order; in-memory loads
    on another."""

    def __init__(self) -> None:
        self._files: ThreadPoolExecutor | None = None
        self._copies: ThreadPoolExecutor | None = None

    def _file_thread(self) -> ThreadPoolExecutor:
        if self._files is None:
            self._files = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-disk")
        return self._files

    def _copy_thread(self) -> ThreadPoolExecutor:
        if self._copies is None:
            self._copies = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-load")
        return self._copies

    def write(self, file: str, pages: BlockPages, stored: torch.cuda.Event | None) -> None:
        """Write `pages` to `file` once the copies into them (`stored`, on CUDA) are done."""
        self._file_thread().submit(_write, file, pages, stored)

    def read(self, file: str, group_id: int) -> BlockPages:
        """Read one block file now, after the writes asked before (the caller waits)."""
        return self._file_thread().submit(read_block_file, file, group_id).result()

    def remove(self, file: str) -> None:
        self._file_thread().submit(_remove, file)

    def load(
        self,
        req_id: str,
        loads: Sequence[tuple[OffloadLoad, BlockPages | None]],
        apply: ApplyPages | None = None,
    ) -> LoadJob:
        """Read a request's pages (files on the file thread, after the writes asked before;
        pages already in memory are passed as they are) and `apply` them, on a thread."""
        job = LoadJob(req_id)
        reads_files = any(pages is None for _, pages in loads)
        executor = self._file_thread() if reads_files else self._copy_thread()
        job.future = executor.submit(job.run, list(loads), apply)
        return job

    def flush(self) -> None:
        """Wait until the work asked so far is done (tests)."""
        for executor in (self._files, self._copies):
            if executor is not None:
                executor.submit(lambda: None).result()


def _write(file: str, pages: BlockPages, stored: torch.cuda.Event | None) -> None:
    if stored is not None:
        stored.synchronize()
    try:
        write_block_file(file, pages)
    except OSError as error:  # a full or broken disk: the later load fails and recomputes
        logger.warning("offload-tier block file %s not written: %s", file, error)


def _remove(file: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(file)


def _read_all(loads: list[tuple[OffloadLoad, BlockPages | None]]) -> LoadedPages:
    out: LoadedPages = []
    for load, pages in loads:
        if pages is None:
            assert load.file is not None
            pages = read_block_file(load.file, load.group_id)
        out.append((load, pages))
    return out

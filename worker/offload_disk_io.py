"""The disk level's file work, off the step: one background thread writes, reads and deletes
block files in the order the steps asked (so a file is read or deleted only after it was
written), while the step goes on. The step imports a request's pages into the pool once all
its reads are done (`take_ready`), so no thread ever writes the pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from scheduler.output import OffloadLoad
from worker.block_export import BlockPages
from worker.offload_disk import BlockFileError, read_block_file, write_block_file

logger = logging.getLogger(__name__)

LoadedPages = list[tuple[OffloadLoad, BlockPages]]
"""A request's loads with the pages each one writes into its block."""


@dataclass
class _Read:
    req_id: str
    started: float
    future: Future[LoadedPages]
    cancelled: bool = False
    """Its request left, or its time ran out: the result is dropped."""


class DiskIO:
    """Block-file writes, reads and deletes on one background thread, in submission order."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._reads: list[_Read] = []

    def _submit(self, function: object, *args: object) -> Future:  # type: ignore[type-arg]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-disk")
        return self._executor.submit(function, *args)  # type: ignore[arg-type]

    def write(self, file: str, pages: BlockPages, stored: torch.cuda.Event | None) -> None:
        """Write `pages` to `file` once the copies into them (`stored`, on CUDA) are done."""
        self._submit(_write, file, pages, stored)

    def remove(self, file: str) -> None:
        self._submit(_remove, file)

    def read(self, req_id: str, loads: Sequence[tuple[OffloadLoad, BlockPages | None]]) -> None:
        """Read the files of a request's loads (pages already in memory are passed as is)."""
        future = self._submit(_read_all, list(loads))
        self._reads.append(_Read(req_id, time.perf_counter(), future))

    def cancel(self, req_ids: Iterable[str]) -> None:
        """These requests left: their reads are dropped when done."""
        left = set(req_ids)
        for read in self._reads:
            read.cancelled = read.cancelled or read.req_id in left

    @property
    def has_reads(self) -> bool:
        return bool(self._reads)

    def take_ready(
        self, timeout_s: float
    ) -> tuple[list[tuple[str, LoadedPages, float]], list[str]]:
        """(requests whose reads are done, with their pages and seconds; requests whose reads
        failed or passed `timeout_s`), leaving the others pending."""
        ready: list[tuple[str, LoadedPages, float]] = []
        failed: list[str] = []
        pending: list[_Read] = []
        now = time.perf_counter()
        for read in self._reads:
            if not read.future.done():
                if not read.cancelled and now - read.started > timeout_s:
                    logger.warning("offload-tier load of %s timed out", read.req_id)
                    failed.append(read.req_id)
                    read.cancelled = True
                pending.append(read)
                continue
            if read.cancelled:
                continue
            try:
                ready.append((read.req_id, read.future.result(), now - read.started))
            except (BlockFileError, OSError, RuntimeError) as error:
                logger.warning("offload-tier load of %s failed: %s", read.req_id, error)
                failed.append(read.req_id)
        self._reads = pending
        return ready, failed


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

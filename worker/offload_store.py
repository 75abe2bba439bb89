"""The worker's side of the offload tier: block pages kept in host memory, by the scheduler's slot.

Each step's `OffloadOps` run before anything else of the step, in order: stores (device → host,
on the compute stream, so they precede the writes of this step's forward), spills (host → a
block file of the disk level, written by a background thread), loads (host → device on their
own stream on CUDA, so the forward does not wait for them; block files are read by the
background thread and imported by a later step), drops, disk drops (by the thread, in order).
A request's loads are reported done once their copies have completed (on CPU: at once); a load
that raises, reads a slot this store does not hold or a file that fails its checks (foreign,
truncated, corrupt: one log line), or is still running after `load_timeout_s`, is reported
failed, and the scheduler recomputes instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from scheduler.output import OffloadLoad, OffloadOps, OffloadSpill, OffloadStore
from worker.block_copies import GroupTensors
from worker.block_export import BlockPages, export_blocks, import_blocks
from worker.offload_disk import BlockFileError
from worker.offload_disk_io import DiskIO

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadReport:
    """Loads that ended since the last report, and what the tier moved."""

    finished: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    load_seconds: float = 0.0
    """Wall time from issue to completion of the loads that finished, summed per request."""


@dataclass
class _LoadBatch:
    req_ids: tuple[str, ...]
    started: float
    event: torch.cuda.Event | None


@dataclass
class HostOffloadStore:
    """Block pages by slot, in (pinned, on CUDA) host memory."""

    tensors: GroupTensors
    num_pool_blocks: int
    device: torch.device
    load_timeout_s: float = 10.0
    waits_for_loads: bool = False
    """A rank whose reports nobody reads (not rank 0): its forwards wait for its own loads, so
    a request rank 0 found loaded is loaded here too."""
    pages: dict[int, BlockPages] = field(default_factory=dict)
    _in_flight: list[_LoadBatch] = field(default_factory=list)
    disk_io: DiskIO = field(default_factory=DiskIO)
    """The disk level's file work, on its own thread."""
    _stream: torch.cuda.Stream | None = None

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    @property
    def nbytes(self) -> int:
        return sum(pages.nbytes for pages in self.pages.values())

    def run(self, ops: OffloadOps, finished_req_ids: Iterable[str] = ()) -> OffloadReport:
        """One step's stores, loads and drops; the loads that ended since the last call.

        The compute stream waits for loads whose blocks may be written by this step's forward:
        those of requests that finished (aborted while loading: their blocks are free again)
        and, on a rank that does not report (rank 0 does), every load in flight."""
        self._fence(set(finished_req_ids))
        if ops.stores:
            self._store(ops.stores)
        if ops.spills:
            self._spill(ops.spills)
        failed: list[str] = []
        if ops.loads:
            failed = self._load(ops.loads)
        for slot in ops.drops:
            self.pages.pop(slot, None)
        for file in ops.disk_drops:
            self.disk_io.remove(file)
        if not self._in_flight and not failed and not self.disk_io.has_reads:
            return OffloadReport()
        return self._collect(failed)

    def _store(self, stores: Iterable[OffloadStore]) -> None:
        by_group: dict[int, list[OffloadStore]] = {}
        for store in stores:
            by_group.setdefault(store.group_id, []).append(store)
        for group_id, group_stores in by_group.items():
            block_ids = [store.block_id for store in group_stores]
            pages = export_blocks(self.tensors, group_id, block_ids, self.num_pool_blocks)
            for index, store in enumerate(group_stores):
                self.pages[store.slot] = pages.block(index)

    def _spill(self, spills: Iterable[OffloadSpill]) -> None:
        """Hand the slots' pages to the disk thread (it waits for the stores into them)."""
        stored = None
        if self.device.type == "cuda":
            stored = torch.cuda.Event()  # type: ignore[no-untyped-call]
            stored.record(torch.cuda.current_stream(self.device))
        for spill in spills:
            pages = self.pages.get(spill.slot)
            if pages is not None:
                self.disk_io.write(spill.file, pages, stored)

    def _load(self, loads: Iterable[OffloadLoad]) -> list[str]:
        """Issue the loads; the requests whose loads could not even start."""
        by_req: dict[str, list[OffloadLoad]] = {}
        for load in loads:
            by_req.setdefault(load.req_id, []).append(load)
        issued: list[str] = []
        failed: list[str] = []
        for req_id in [r for r, req_loads in by_req.items() if any(x.file for x in req_loads)]:
            self._read_files(req_id, by_req.pop(req_id))
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after this step's stores
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for req_id, req_loads in by_req.items():
                try:
                    self._load_request(req_loads)
                except (KeyError, RuntimeError, AssertionError, BlockFileError) as error:
                    logger.warning("offload-tier load of %s failed: %s", req_id, error)
                    failed.append(req_id)
                else:
                    issued.append(req_id)
        event = None
        if stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        self._in_flight.append(_LoadBatch(tuple(issued), time.perf_counter(), event))
        return failed

    def _load_request(self, loads: list[OffloadLoad]) -> None:
        for load in loads:
            assert load.slot is not None
            self._import(load, self.pages[load.slot])

    def _import(self, load: OffloadLoad, pages: BlockPages) -> None:
        assert pages.group_id == load.group_id, "pages of another group"
        import_blocks(self.tensors, pages, [load.block_id], self.num_pool_blocks)

    def _read_files(self, req_id: str, loads: list[OffloadLoad]) -> None:
        """A request with loads from disk: its files are read off the step (its host slots'
        pages go along), and all its pages are imported once they are in memory."""
        self.disk_io.read(req_id, [(x, self.pages.get(x.slot) if x.slot else None) for x in loads])

    def _import_read(self, finished: list[str], failed: list[str]) -> float:
        """Import the requests whose files are read; their seconds."""
        ready, late = self.disk_io.take_ready(self.load_timeout_s)
        failed.extend(late)
        seconds = 0.0
        for req_id, loaded, elapsed in ready:
            try:
                for load, pages in loaded:
                    self._import(load, pages)
            except (AssertionError, RuntimeError) as error:
                logger.warning("offload-tier load of %s failed: %s", req_id, error)
                failed.append(req_id)
                continue
            finished.append(req_id)
            seconds += elapsed
        return seconds

    def _fence(self, finished: set[str]) -> None:
        if finished:
            self.disk_io.cancel(finished)
        if not self._in_flight or self._stream is None:
            return
        compute = torch.cuda.current_stream(self.device)
        for batch in self._in_flight:
            if batch.event is not None and (self.waits_for_loads or finished & set(batch.req_ids)):
                compute.wait_event(batch.event)

    def _collect(self, failed: list[str]) -> OffloadReport:
        """Loads done or past their deadline; a timed-out batch is waited for by the compute
        stream (its blocks may be reused) and reported failed."""
        finished: list[str] = []
        seconds = 0.0
        now = time.perf_counter()
        running: list[_LoadBatch] = []
        for batch in self._in_flight:
            done = batch.event is None or batch.event.query()  # type: ignore[no-untyped-call]
            late = now - batch.started > self.load_timeout_s
            if late:
                if batch.event is not None:
                    torch.cuda.current_stream(self.device).wait_event(batch.event)
                logger.warning("offload-tier loads of %d requests timed out", len(batch.req_ids))
                failed.extend(batch.req_ids)
            elif done:
                finished.extend(batch.req_ids)
                seconds += (now - batch.started) * len(batch.req_ids)
            else:
                running.append(batch)
        self._in_flight = running
        seconds += self._import_read(finished, failed)
        return OffloadReport(tuple(finished), tuple(failed), seconds)

    def clear(self) -> None:
        """Forget every page (the scheduler's index was reset)."""
        self.pages.clear()

"""The worker's side of the offload tier: block pages kept in host memory, by the scheduler's slot.

Each step's `OffloadOps` run before anything else of the step, in order: stores (device → host,
on the compute stream, so they precede the writes of this step's forward), spills (host → a
block file of the disk level, written by a background thread), loads, drops, disk drops (by the
thread, in order). Loads never hold up the step: on CUDA host pages are copied on a stream of
their own; block files, and on CPU every page, are read and copied into the pool by background
threads (`worker.kv_io.offload_disk_io`) while the step's forward runs other requests.

A request's loads are reported done once their copies completed on every tensor-parallel rank
(the ranks agree each step while loads are pending); a load that raises, reads a slot this
store does not hold or a file that fails its checks (foreign, truncated, corrupt, or missing on
one rank: one log line), or is still running after `load_timeout_s`, fails on every rank, and
the scheduler recomputes instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from scheduler.output import OffloadLoad, OffloadOps, OffloadSpill, OffloadStore, TierPage
from worker.block_copies import GroupTensors
from worker.distributed import all_reduce, tp_rank, tp_size
from worker.kv_io.block_export import BlockPages, export_blocks, import_blocks
from worker.kv_io.offload_disk_io import LOAD_ERRORS, DiskIO, LoadedPages, LoadJob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadReport:
    """Loads that ended since the last report, and what the tier moved."""

    finished: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    load_seconds: float = 0.0
    """Wall time from issue to completion of the loads that finished, summed per request."""


class LoadState(IntEnum):
    RUNNING = 0
    DONE = 1
    FAILED = 2


@dataclass
class _RequestLoads:
    """One request's loads in flight on this rank."""

    started: float
    job: LoadJob | None = None
    """Pages read (and on CPU copied into the pool) by a background thread."""
    event: torch.cuda.Event | None = None
    """CUDA: recorded on the load stream after the pages' copies into the pool."""
    failed: bool = False


@dataclass
class HostOffloadStore:
    """Block pages by slot, in (pinned, on CUDA) host memory."""

    tensors: GroupTensors
    num_pool_blocks: int
    device: torch.device
    load_timeout_s: float = 10.0
    pages: dict[int, BlockPages] = field(default_factory=dict)
    disk_io: DiskIO = field(default_factory=DiskIO)
    """File work and CPU page copies, on background threads."""
    _loads: dict[str, _RequestLoads] = field(default_factory=dict)
    """Requests with loads not reported yet, in issue order (the same on every rank)."""
    _stream: torch.cuda.Stream | None = None

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    @property
    def nbytes(self) -> int:
        return sum(pages.nbytes for pages in self.pages.values())

    @property
    def pending_loads(self) -> tuple[str, ...]:
        """Requests whose loads are not reported yet."""
        return tuple(self._loads)

    def run(self, ops: OffloadOps, finished_req_ids: Iterable[str] = ()) -> OffloadReport:
        """One step's stores, loads and drops; the loads that ended since the last call.
        Loads of requests that finished (aborted while loading: their blocks are free again)
        end first, so nothing writes those blocks once this step's forward may."""
        for req_id in finished_req_ids:
            self._end(req_id)
        if ops.stores:
            self._store(ops.stores)
        if ops.spills:
            self._spill(ops.spills)
        if ops.loads:
            self._issue(ops.loads)
        for slot in ops.drops:
            self.pages.pop(slot, None)
        for file in ops.disk_drops:
            self.disk_io.remove(shard_file(file))
        if not self._loads:
            return OffloadReport()
        return self._report()

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
                self.disk_io.write(shard_file(spill.file), pages, stored)

    def _issue(self, loads: Iterable[OffloadLoad]) -> None:
        """Start each request's loads: host pages in memory on CUDA's load stream, the rest
        (files; everything on CPU) on a thread."""
        by_req: dict[str, list[OffloadLoad]] = {}
        for load in loads:
            by_req.setdefault(load.req_id, []).append(load)
        for req_id, req_loads in by_req.items():
            state = _RequestLoads(time.perf_counter())
            self._loads[req_id] = state
            try:
                sources = [(_shard_load(x), self._in_memory(x)) for x in req_loads]
            except KeyError as error:
                logger.warning("offload-tier load of %s failed: no slot %s", req_id, error)
                state.failed = True
                continue
            if self._stream is not None and all(pages is not None for _, pages in sources):
                state.event = self._copy_on_stream([(x, p) for x, p in sources if p is not None])
            else:
                apply = self._apply if self._stream is None else None
                state.job = self.disk_io.load(req_id, sources, apply)

    def read_page(self, page: TierPage, group_id: int) -> BlockPages:
        """One entry's pages as they are in host memory, or read from this rank's block file
        (a KV transfer sends them); KeyError or a `LOAD_ERRORS` error when it is gone."""
        if page.file is not None:
            return self.disk_io.read(shard_file(page.file), group_id)
        if page.slot is None:
            raise KeyError("none")
        return self.pages[page.slot]

    def _in_memory(self, load: OffloadLoad) -> BlockPages | None:
        """The pages of a host load (KeyError: this store has none under its slot); None for a
        file."""
        if load.file is not None:
            return None
        if load.slot is None:
            raise KeyError("none")
        return self.pages[load.slot]

    def _apply(self, loaded: LoadedPages) -> None:
        for load, pages in loaded:
            assert pages.group_id == load.group_id, "pages of another group"
            import_blocks(self.tensors, pages, [load.block_id], self.num_pool_blocks)

    def _copy_on_stream(self, loaded: LoadedPages) -> torch.cuda.Event:
        """CUDA: copy pages into the pool on the load stream, after this step's stores."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._apply(loaded)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._stream)
        return event

    def _local_state(self, req_id: str, loads: _RequestLoads, now: float) -> LoadState:
        if loads.failed:
            return LoadState.FAILED
        if loads.job is not None:
            try:
                loaded = loads.job.result()
            except LOAD_ERRORS as error:
                logger.warning("offload-tier load of %s failed: %s", req_id, error)
                loads.failed = True
                return LoadState.FAILED
            if loaded is not None:
                loads.job = None
                if self._stream is not None:  # CUDA: files read, now copied on the stream
                    loads.event = self._copy_on_stream(loaded)
        if now - loads.started > self.load_timeout_s:  # not seen complete within its time
            logger.warning("offload-tier load of %s timed out", req_id)
            loads.failed = True
            return LoadState.FAILED
        running = loads.job is not None or (
            loads.event is not None and not loads.event.query()  # type: ignore[no-untyped-call]
        )
        return LoadState.RUNNING if running else LoadState.DONE

    def _report(self) -> OffloadReport:
        """The loads every rank finished, and those failed on any rank (they end here)."""
        now = time.perf_counter()
        req_ids = list(self._loads)
        states = self._agree([self._local_state(r, self._loads[r], now) for r in req_ids])
        finished: list[str] = []
        failed: list[str] = []
        seconds = 0.0
        for req_id, state in zip(req_ids, states, strict=True):
            if state is LoadState.DONE:
                seconds += now - self._loads.pop(req_id).started
                finished.append(req_id)
            elif state is LoadState.FAILED:
                self._end(req_id)
                failed.append(req_id)
        return OffloadReport(tuple(finished), tuple(failed), seconds)

    def _agree(self, states: list[LoadState]) -> list[LoadState]:
        """Per request, the state over all ranks: failed on any, else running on any, else
        done (every rank calls this with the same requests)."""
        if tp_size() == 1:
            return states
        flags = [s is LoadState.FAILED for s in states] + [s is LoadState.RUNNING for s in states]
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        summed = all_reduce(torch.tensor(flags, dtype=torch.int32, device=device)).tolist()
        count = len(states)
        return [
            LoadState.FAILED
            if summed[i]
            else LoadState.RUNNING
            if summed[count + i]
            else LoadState.DONE
            for i in range(count)
        ]

    def _end(self, req_id: str) -> None:
        """Nothing of this request's loads writes the pool from now on."""
        loads = self._loads.pop(req_id, None)
        if loads is None:
            return
        if loads.job is not None:
            loads.job.cancel()
        if loads.event is not None:
            torch.cuda.current_stream(self.device).wait_event(loads.event)

    def clear(self) -> None:
        """Forget every page (the scheduler's index was reset)."""
        self.pages.clear()


def shard_file(file: str) -> str:
    """This rank's block file for the scheduler's `file`: the same name in the folder of the
    fingerprint with `-rank<r>` appended on ranks other than 0 (each rank keeps its own shard,
    and the scheduler's index of rank 0's files is authoritative: a shard missing on one rank
    is a failed load)."""
    rank = tp_rank()
    if rank == 0:
        return file
    folder, name = os.path.split(file)
    return os.path.join(f"{folder}-rank{rank}", name)


def _shard_load(load: OffloadLoad) -> OffloadLoad:
    return load if load.file is None else load._replace(file=shard_file(load.file))

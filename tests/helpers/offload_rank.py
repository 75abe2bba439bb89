"""One tensor-parallel rank of the offload-store tests, run in a spawned process: it joins a gloo
group, keeps a `HostOffloadStore` over CPU tensors, and runs the steps the parent describes,
saving every report and the files it wrote."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from scheduler.output import OffloadLoad, OffloadOps, OffloadSpill, OffloadStore
from worker.distributed import destroy_distributed, init_distributed
from worker.kv_io.offload_store import HostOffloadStore, OffloadReport

NUM_BLOCKS = 4


def run_offload_rank(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    """Slot 1 is stored on every rank, slot 2 on rank 0 only; request `a` loads slot 1, `b`
    slot 2, `c` a file spilled from slot 1 (every rank its own shard)."""
    torch.set_num_threads(1)
    init_distributed(rank, world_size, init_method, backend="gloo")
    try:
        tensors = {0: [torch.full((NUM_BLOCKS, 3), float(rank + 1))]}
        store = HostOffloadStore(tensors, NUM_BLOCKS, torch.device("cpu"))
        stores = (OffloadStore(1, 0, 0),) + ((OffloadStore(2, 0, 1),) if rank == 0 else ())
        file = str(Path(out_dir) / "fingerprint" / "g0-ab-1.kv")
        store.run(OffloadOps(stores=stores, spills=(OffloadSpill(1, file),)))
        store.disk_io.flush()
        loads = (
            OffloadLoad("a", 0, 2, slot=1),
            OffloadLoad("b", 0, 3, slot=2),
            OffloadLoad("c", 0, 3, None, file),
        )
        reports = [store.run(OffloadOps(loads=loads))]
        deadline = time.monotonic() + 10
        while store.pending_loads and time.monotonic() < deadline:
            time.sleep(0.01)
            reports.append(store.run(OffloadOps()))
        torch.save(
            {"reports": [_as_dict(r) for r in reports], "files": _files(out_dir)},
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        destroy_distributed()


def _as_dict(report: OffloadReport) -> dict[str, tuple[str, ...]]:
    return {"finished": report.finished, "failed": report.failed}


def _files(out_dir: str) -> list[str]:
    return sorted(str(p.relative_to(out_dir)) for p in Path(out_dir).rglob("*.kv"))

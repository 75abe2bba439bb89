"""Block export/import and the host offload store on CPU tensors shaped like a KV pool."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from scheduler.output import OffloadLoad, OffloadOps, OffloadSpill, OffloadStore
from worker.kv_io.block_export import export_blocks, import_blocks
from worker.kv_io.offload_store import HostOffloadStore, OffloadReport

NUM_BLOCKS = 8


def _tensors() -> dict[int, list[torch.Tensor]]:
    """Group 0: K/V-like tensor split in 2 kernel blocks per pool block; group 1: one state."""
    generator = torch.Generator().manual_seed(0)
    return {
        0: [torch.randn(NUM_BLOCKS * 2, 3, generator=generator)],
        1: [torch.randn(NUM_BLOCKS, 5, generator=generator)],
    }


def test_export_then_import_moves_every_row_of_the_blocks() -> None:
    tensors = _tensors()
    before = tensors[0][0][6:8].clone()
    pages = export_blocks(tensors, 0, [3], NUM_BLOCKS)
    assert pages.nbytes == 2 * 3 * 4
    import_blocks(tensors, pages, [5], NUM_BLOCKS)
    assert torch.equal(tensors[0][0][10:12], before)


def test_store_load_round_trip_and_drop() -> None:
    tensors = _tensors()
    store = HostOffloadStore(tensors, NUM_BLOCKS, torch.device("cpu"))
    state = tensors[1][0][2].clone()
    store.run(OffloadOps(stores=(OffloadStore(7, 1, 2),)))
    tensors[1][0][2] = 0  # the pool reuses the block
    ops = OffloadOps(loads=(OffloadLoad("r", 1, 4, slot=7),), drops=(7,))
    report = _until_reported(store, ops)
    assert report.finished == ("r",)
    assert report.failed == ()
    assert torch.equal(tensors[1][0][4], state)
    assert store.pages == {}


def test_a_load_of_a_missing_slot_fails() -> None:
    store = HostOffloadStore(_tensors(), NUM_BLOCKS, torch.device("cpu"))
    report = store.run(OffloadOps(loads=(OffloadLoad("r", 0, 1, slot=9),)))
    assert report.failed == ("r",)
    assert report.finished == ()


def test_a_load_past_its_deadline_fails() -> None:
    tensors = _tensors()
    store = HostOffloadStore(tensors, NUM_BLOCKS, torch.device("cpu"), load_timeout_s=0)
    store.run(OffloadOps(stores=(OffloadStore(1, 0, 2),)))
    before = tensors[0][0].clone()
    release = _held_copy_thread(store)
    report = store.run(OffloadOps(loads=(OffloadLoad("r", 0, 3, slot=1),)))
    release.set()
    store.disk_io.flush()
    assert report.failed == ("r",)
    assert torch.equal(tensors[0][0], before)  # a load that timed out never writes the pool


def _held_copy_thread(store: HostOffloadStore) -> threading.Event:
    """Keep the store's copy thread busy until the returned event is set."""
    release = threading.Event()
    store.disk_io.load("gate", [], lambda _: release.wait(10))
    return release


def test_a_step_does_not_wait_for_its_loads() -> None:
    """With the copy thread busy, the step issuing a load returns at once and reports it
    pending; it is reported done (block written) in a later step."""
    tensors = _tensors()
    store = HostOffloadStore(tensors, NUM_BLOCKS, torch.device("cpu"))
    store.run(OffloadOps(stores=(OffloadStore(1, 0, 2),)))
    expected = tensors[0][0][4:6].clone()
    release = _held_copy_thread(store)
    report = store.run(OffloadOps(loads=(OffloadLoad("r", 0, 5, slot=1),)))
    assert report == OffloadReport()
    assert store.pending_loads == ("r",)
    assert not torch.equal(tensors[0][0][10:12], expected)
    release.set()
    report = _until_reported(store, OffloadOps())
    assert report.finished == ("r",)
    assert torch.equal(tensors[0][0][10:12], expected)
    assert store.pending_loads == ()


def test_a_request_that_left_while_loading_never_has_its_blocks_written() -> None:
    tensors = _tensors()
    store = HostOffloadStore(tensors, NUM_BLOCKS, torch.device("cpu"))
    store.run(OffloadOps(stores=(OffloadStore(1, 0, 2),)))
    before = tensors[0][0].clone()
    release = _held_copy_thread(store)
    store.run(OffloadOps(loads=(OffloadLoad("r", 0, 5, slot=1),)))
    report = store.run(OffloadOps(), finished_req_ids=("r",))
    release.set()
    store.disk_io.flush()
    assert report == OffloadReport()
    assert store.pending_loads == ()
    assert torch.equal(tensors[0][0], before)


def _until_reported(store: HostOffloadStore, ops: OffloadOps) -> OffloadReport:
    """Run `ops`, then empty steps until a load is reported (file reads run on a thread)."""
    report = store.run(ops)
    deadline = time.monotonic() + 10
    while not (report.finished or report.failed) and time.monotonic() < deadline:
        time.sleep(0.01)
        report = store.run(OffloadOps())
    return report


def _spilled(tmp_path: Path) -> tuple[dict[int, list[torch.Tensor]], HostOffloadStore, str]:
    """A store whose slot 1 (group 1, block 2) was spilled to a file and dropped from memory."""
    tensors = _tensors()
    store = HostOffloadStore(tensors, NUM_BLOCKS, torch.device("cpu"))
    file = str(tmp_path / "fingerprint" / "g1-ab.kv")
    store.run(OffloadOps(stores=(OffloadStore(1, 1, 2),)))
    store.run(OffloadOps(spills=(OffloadSpill(1, file),), drops=(1,)))
    assert store.pages == {}
    store.disk_io.flush()
    return tensors, store, file


def test_a_spilled_block_loads_back_from_its_file(tmp_path: Path) -> None:
    tensors, store, file = _spilled(tmp_path)
    state = tensors[1][0][2].clone()
    report = _until_reported(store, OffloadOps(loads=(OffloadLoad("r", 1, 6, None, file),)))
    assert report.finished == ("r",)
    assert torch.equal(tensors[1][0][6], state)
    store.run(OffloadOps(disk_drops=(file,)))
    store.disk_io.flush()
    assert not Path(file).exists()


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "other_group", "garbage"])
def test_a_damaged_or_foreign_file_is_never_loaded(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    tensors, store, file = _spilled(tmp_path)
    data = bytearray(Path(file).read_bytes())
    group = 1
    if damage == "corrupt":
        data[-9] ^= 0xFF
    elif damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "foreign":  # a valid file of another fingerprint, copied in
        other = tmp_path / "another" / "g1-ab.kv"
        other.parent.mkdir()
        other.write_bytes(data)
        file = str(other)
    elif damage == "other_group":
        group = 0
    else:
        data = bytearray(b"not a block file at all")
    if damage not in ("foreign", "other_group"):
        Path(file).write_bytes(data)
    before = tensors[group][0].clone()
    with caplog.at_level(logging.WARNING):
        report = _until_reported(store, OffloadOps(loads=(OffloadLoad("r", group, 6, None, file),)))
    assert report.failed == ("r",)
    assert torch.equal(tensors[group][0], before)  # nothing was written
    assert len([r for r in caplog.records if "offload-tier load" in r.getMessage()]) == 1

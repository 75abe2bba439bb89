"""Block export/import and the host offload store on CPU tensors shaped like a KV pool."""

from __future__ import annotations

import torch

from scheduler.output import OffloadLoad, OffloadOps, OffloadStore
from worker.block_export import export_blocks, import_blocks
from worker.offload_store import HostOffloadStore

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
    report = store.run(OffloadOps(loads=(OffloadLoad("r", 7, 1, 4),), drops=(7,)))
    assert report.finished == ("r",)
    assert report.failed == ()
    assert torch.equal(tensors[1][0][4], state)
    assert store.pages == {}


def test_a_load_of_a_missing_slot_fails() -> None:
    store = HostOffloadStore(_tensors(), NUM_BLOCKS, torch.device("cpu"))
    report = store.run(OffloadOps(loads=(OffloadLoad("r", 9, 0, 1),)))
    assert report.failed == ("r",)
    assert report.finished == ()


def test_a_load_past_its_deadline_fails() -> None:
    tensors = _tensors()
    store = HostOffloadStore(tensors, NUM_BLOCKS, torch.device("cpu"), load_timeout_s=0)
    store.run(OffloadOps(stores=(OffloadStore(1, 0, 2),)))
    report = store.run(OffloadOps(loads=(OffloadLoad("r", 1, 0, 3),)))
    assert report.failed == ("r",)

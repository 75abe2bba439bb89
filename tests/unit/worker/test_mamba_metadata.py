"""Which blocks the Mamba layers read and write per request and step, per cache mode, and the
waves that order a same-step hit after the request writing its state."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from kernels.mamba_registry import select_mamba_kernels
from scheduler.kv_cache.spec import MambaCacheMode
from worker.attention.block_table import MultiGroupBlockTable
from worker.input_batch import RequestStates
from worker.state.mamba_metadata import build_mamba_metadata

BS = 4


def _metadata(rows: dict[str, list[int]], steps: dict[str, tuple[int, int]], mode: MambaCacheMode):
    tables = MultiGroupBlockTable([BS], [BS], max_num_reqs=4, max_model_len=64)
    states = RequestStates(tables, torch.device("cpu"))
    for row, (req_id, block_ids) in enumerate(rows.items()):
        states.rows[req_id] = row
        tables.add_row([block_ids], row)
    computed = np.array([steps[r][0] for r in rows])
    qsl = np.concatenate([[0], np.cumsum([steps[r][1] for r in rows])])
    batch = SimpleNamespace(req_ids=list(rows), num_computed_np=computed, query_start_loc_np=qsl)
    return build_mamba_metadata(
        batch, states, {0: (BS, mode)}, select_mamba_kernels("torch", "cpu")
    )[0]  # type: ignore[arg-type]


def test_all_mode_saves_every_block_end_and_orders_same_step_readers() -> None:
    meta = _metadata(
        {"a": [5, 6, 7], "b": [0, 6, 9]}, {"a": (0, 10), "b": (8, 1)}, MambaCacheMode.ALL
    )
    first, second = meta.waves  # b reads block 6, which a writes at its cut 8 in this step
    assert first.query_start_loc == [0, 10]
    assert first.cut_positions == [4, 8]
    assert first.cut_blocks.tolist() == [5, 6]
    assert first.write_blocks.tolist() == [7]
    assert first.has_state.tolist() == [False]
    assert second.token_index.tolist() == [10]
    assert second.read_blocks.tolist() == [6]
    assert second.write_blocks.tolist() == [9]
    assert second.has_state.tolist() == [True]


def test_align_mode_skips_null_entries_and_none_mode_uses_one_block() -> None:
    (wave,) = _metadata({"a": [0, 0, 7]}, {"a": (0, 10)}, MambaCacheMode.ALIGN).waves
    assert wave.token_index is None
    assert wave.cut_positions == []
    assert wave.write_blocks.tolist() == [7]
    (wave,) = _metadata({"a": [3]}, {"a": (5, 1)}, MambaCacheMode.NONE).waves
    assert wave.read_blocks.tolist() == [3]
    assert wave.write_blocks.tolist() == [3]
    assert wave.has_state.tolist() == [True]

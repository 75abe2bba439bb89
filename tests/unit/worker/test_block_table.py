"""Per-group block tables: rows from scheduler deltas, kernel block splitting, slot mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scheduler.output import NewRequestData, SchedulerOutput
from scheduler.request import SamplingParams
from worker.attention.block_table import (
    BlockTable,
    MultiGroupBlockTable,
    choose_kernel_block_size,
    split_block_ids,
)
from worker.input_batch import RequestStates, build_input_batch

S28_SLOTS_GROUP0 = [62, 63, 112, 113, 114, 147, 148]
S28_SLOTS_GROUP1 = [174, 175, 176, 177, 178, 67, 68]


def _s28_tables() -> MultiGroupBlockTable:
    tables = MultiGroupBlockTable([16, 32], [16, 16], max_num_reqs=4, max_model_len=128)
    tables.add_row(([3, 7], [5]), row=0)  # A
    tables.add_row(([9], [2]), row=1)  # B
    return tables


def test_s28_slot_mapping_per_group_and_kernel_block_size() -> None:
    tables = _s28_tables()
    # A: computed 14, scheduled 5 -> positions 14..18; B: computed 3, scheduled 2 -> 3, 4.
    rows = np.array([0] * 5 + [1] * 2)
    positions = np.array([14, 15, 16, 17, 18, 3, 4])
    assert tables[0].slot_mapping(rows, positions).tolist() == S28_SLOTS_GROUP0
    assert tables[1].slot_mapping(rows, positions).tolist() == S28_SLOTS_GROUP1
    assert tables[1].gather_rows(np.array([0, 1])).tolist() == [[10, 11], [4, 5]]
    assert tables[0].gather_rows(np.array([0, 1])).tolist() == [[3, 7], [9, 0]]


def test_s28_through_the_input_batch() -> None:
    """The same scenario driven by a SchedulerOutput (new requests with prefix hits)."""
    tables = MultiGroupBlockTable([16, 32], [16, 16], max_num_reqs=4, max_model_len=128)
    states = RequestStates(tables, torch.device("cpu"))
    params = SamplingParams(temperature=0)
    output = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("A", list(range(19)), params, ([3, 7], [5]), 14),
            NewRequestData("B", list(range(100, 105)), params, ([9], [2]), 3),
        ],
        scheduled_cached_reqs=[],
        num_scheduled_tokens={"A": 5, "B": 2},
        total_num_scheduled_tokens=7,
        num_common_prefix_blocks=(0, 0),
        finished_req_ids=frozenset(),
    )
    states.update(output)
    batch = build_input_batch(["A", "B"], states, output.num_scheduled_tokens)
    assert batch.slot_mappings[0].tolist() == S28_SLOTS_GROUP0
    assert batch.slot_mappings[1].tolist() == S28_SLOTS_GROUP1
    assert batch.block_tables[1].tolist() == [[10, 11], [4, 5]]
    assert batch.positions.tolist() == [14, 15, 16, 17, 18, 3, 4]


def test_append_extends_and_add_replaces_a_row() -> None:
    table = BlockTable(block_size=4, kernel_block_size=4, max_num_reqs=2, max_model_len=64)
    table.add_row([1, 2], row=0)
    table.append_row([5], row=0)
    table.append_row([], row=0)
    assert table.gather_rows(np.array([0])).tolist() == [[1, 2, 5]]
    table.add_row([9], row=0)  # resumed request: complete replacement
    assert table.num_blocks_per_row[0] == 1
    assert table.table_np[0, :3].tolist() == [9, 0, 0]


def test_row_overflow_is_an_error() -> None:
    table = BlockTable(block_size=4, kernel_block_size=4, max_num_reqs=1, max_model_len=8)
    table.add_row([1, 2], row=0)
    with pytest.raises(ValueError, match="max_model_len"):
        table.append_row([3], row=0)


def test_kernel_block_split_maps_block_b_to_b_f_through_b_f_plus_f_minus_1() -> None:
    assert split_block_ids([5, 2], 4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11]
    assert split_block_ids([5, 2], 1).tolist() == [5, 2]
    table = BlockTable(block_size=64, kernel_block_size=16, max_num_reqs=1, max_model_len=128)
    table.add_row([3, 1], row=0)
    assert table.gather_rows(np.array([0])).tolist() == [[12, 13, 14, 15, 4, 5, 6, 7]]
    # position 70: scheduler block 1 (id 1), offset 6 -> kernel block 4, slot 4 * 16 + 6
    slots = table.slot_mapping(np.array([0, 0]), np.array([70, 127]))
    assert slots.tolist() == [1 * 64 + 6, 1 * 64 + 63]


def test_choose_kernel_block_size_takes_largest_supported_divisor() -> None:
    assert choose_kernel_block_size(32, lambda size: True) == 32
    assert choose_kernel_block_size(48, lambda size: size % 16 == 0 and size <= 32) == 16
    assert choose_kernel_block_size(64, lambda size: size in (16, 32)) == 32
    with pytest.raises(ValueError, match="block_size"):
        choose_kernel_block_size(24, lambda size: size % 16 == 0)

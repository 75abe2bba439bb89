"""Block copies of the KV pool (`worker.block_copies`): rows per block, sources read first."""

from __future__ import annotations

import torch

from scheduler.output import BlockCopy, StateSave
from worker.block_copies import copy_blocks, saves_by_request


def test_copies_move_every_row_of_a_block_in_its_group_only() -> None:
    num_blocks = 4
    keys = torch.arange(num_blocks * 2 * 3, dtype=torch.float32).view(num_blocks * 2, 3)
    states = torch.arange(num_blocks * 5, dtype=torch.float32).view(num_blocks, 5)
    other = torch.zeros(num_blocks, 2)
    original_keys, original_states = keys.clone(), states.clone()
    tensors = {0: [keys], 1: [states], 2: [other]}
    copy_blocks([BlockCopy(0, 1, 3), BlockCopy(1, 2, 0)], tensors, num_blocks)
    assert torch.equal(keys[6:8], original_keys[2:4])  # block 1 = kernel rows 2, 3
    assert torch.equal(keys[:6], original_keys[:6])
    assert torch.equal(states[0], original_states[2])
    assert torch.equal(states[1:], original_states[1:])
    assert not other.any()


def test_a_block_both_source_and_destination_is_read_before_it_is_written() -> None:
    states = torch.arange(3, dtype=torch.float32).view(3, 1)
    copy_blocks([BlockCopy(0, 1, 2), BlockCopy(0, 0, 1)], {0: [states]}, 3)
    assert states.view(-1).tolist() == [0.0, 0.0, 1.0]


def test_saves_are_grouped_by_group_then_request() -> None:
    saves = [StateSave("a", 8, 2, 5), StateSave("b", 4, 2, 6), StateSave("a", 12, 3, 7)]
    assert saves_by_request(saves) == {2: {"a": [(8, 5)], "b": [(4, 6)]}, 3: {"a": [(12, 7)]}}

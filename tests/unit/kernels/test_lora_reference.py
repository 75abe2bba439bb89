"""The batched LoRA matmuls (reference and torch path) against a per-row dense loop."""

from __future__ import annotations

import pytest
import torch

from kernels import lora_reference, lora_torch
from kernels.lora_reference import LoRALayout, LoRASegments, lora_expand, lora_segments, lora_shrink
from kernels.lora_registry import select_lora_kernels

NUM_SLOTS, RANK, D_IN, D_OUT = 5, 4, 8, 6
CPU = torch.device("cpu")

# row -> slot (-1: no adapter), and the layout the step must get
SLOT_MIXES = {
    "one adapter, every row": ([3] * 6, LoRALayout.ONE_ADAPTER),
    "one adapter, some rows bare": ([3, -1, 3, 3], LoRALayout.PADDED),
    "decodes, four adapters": ([0, 2, 4, 1, 0, 2, 4, 1], LoRALayout.PADDED),
    "decodes, uneven, slots apart": ([4, -1, 1, 4, 4, -1, 1], LoRALayout.PADDED),
    "long prefill beside decodes": ([2] * 12 + [0, -1, 4], LoRALayout.SEGMENTS),
}


def per_row_loop(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, base: torch.Tensor,
                 row_slots: list[int]) -> torch.Tensor:  # fmt: skip
    """Each row plus its own adapter's delta, one row at a time."""
    expected = base.clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            expected[row] += b[slot] @ (a[slot] @ x[row])
    return expected


def random_case(num_rows: int) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(num_rows)
    x = torch.randn(num_rows, D_IN)
    lora_a = torch.randn(NUM_SLOTS, RANK, D_IN)
    lora_b = torch.randn(NUM_SLOTS, D_OUT, RANK)
    return x, lora_a, lora_b, torch.randn(num_rows, D_OUT)


def test_segment_matmuls_equal_each_token_times_its_own_adapter() -> None:
    x, lora_a, lora_b, base = random_case(9)
    row_slots = [0, 0, -1, 2, -1, 1, -1, 2, 2]
    segments = LoRASegments(torch.tensor([3, 7, 8, 0, 1, 5]), slot_ids=(2, 0, 1), lengths=(3, 2, 1))
    out = lora_expand(base, lora_shrink(x, lora_a, segments), lora_b, segments)
    torch.testing.assert_close(out, per_row_loop(x, lora_a, lora_b, base, row_slots))
    assert torch.equal(out[[2, 4, 6]], base[[2, 4, 6]])


@pytest.mark.parametrize("mix", SLOT_MIXES)
def test_torch_path_equals_per_row_loop_in_every_layout(mix: str) -> None:
    row_slots, layout = SLOT_MIXES[mix]
    x, lora_a, lora_b, base = random_case(len(row_slots))
    segments = lora_segments(torch.tensor(row_slots), CPU)
    assert segments is not None
    assert segments.layout is layout
    expected = per_row_loop(x, lora_a, lora_b, base, row_slots)
    for kernels in (lora_torch, lora_reference):
        out = kernels.lora_expand(base, kernels.lora_shrink(x, lora_a, segments), lora_b, segments)
        torch.testing.assert_close(out, expected)
    bare = [row for row, slot in enumerate(row_slots) if slot < 0]
    assert torch.equal(out[bare], base[bare])


def test_segments_are_built_once_with_slot_ranges_and_padding() -> None:
    segments = lora_segments(torch.tensor([1, 2, -1, 1, 2, 2]), CPU)
    assert segments is not None
    assert segments.token_idx.tolist() == [0, 3, 1, 4, 5]
    assert (segments.slot_ids, segments.lengths) == ((1, 2), (2, 3))
    assert segments.slot_range == (1, 3)  # consecutive slots: the weights are a view
    assert segments.padded_idx is not None
    assert segments.padded_idx.tolist() == [0, 3, 0, 1, 4, 5]  # slot 1 padded with its row 0
    assert segments.pad_mask is not None
    assert segments.pad_mask.flatten().tolist() == [True, True, False, True, True, True]
    assert segments.row_slots is not None
    assert segments.row_slots.tolist() == [1, 2, -1, 1, 2, 2]
    apart = lora_segments(torch.tensor([4, 0]), CPU)
    assert apart is not None
    assert apart.slot_range is None


def test_no_adapter_rows_give_no_segments_and_empty_segments_change_nothing() -> None:
    assert lora_segments(torch.tensor([-1, -1]), CPU) is None
    segments = LoRASegments(torch.zeros(0, dtype=torch.int64), slot_ids=(), lengths=())
    base = torch.randn(4, 6)
    shrunk = lora_shrink(torch.randn(4, 8), torch.randn(2, 3, 8), segments)
    assert shrunk.shape == (0, 3)
    assert torch.equal(lora_expand(base, shrunk, torch.randn(2, 6, 3), segments), base)


def test_registry_picks_the_torch_path_on_cpu_and_names_bad_requests() -> None:
    assert select_lora_kernels("auto", "cpu").name == "torch"
    assert select_lora_kernels("reference", "cpu").shrink is lora_reference.lora_shrink
    with pytest.raises(ValueError, match="unknown LoRA kernels 'fast'"):
        select_lora_kernels("fast", "cpu")
    with pytest.raises(ValueError, match=r"Triton LoRA kernels are unavailable: .*CUDA"):
        select_lora_kernels("triton", "cpu")

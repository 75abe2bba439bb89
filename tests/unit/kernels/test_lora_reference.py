"""The batched LoRA matmuls against a per-token dense computation."""

from __future__ import annotations

import torch

from kernels.lora_reference import LoRASegments, lora_expand, lora_shrink


def test_segment_matmuls_equal_each_token_times_its_own_adapter() -> None:
    torch.manual_seed(0)
    num_tokens, num_slots, rank, d_in, d_out = 9, 3, 4, 8, 6
    x = torch.randn(num_tokens, d_in)
    lora_a = torch.randn(num_slots, rank, d_in)
    lora_b = torch.randn(num_slots, d_out, rank)
    base = torch.randn(num_tokens, d_out)
    slot_of = {3: 2, 7: 2, 8: 2, 0: 0, 1: 0, 5: 1}  # tokens 2, 4 and 6 use no adapter
    order = [3, 7, 8, 0, 1, 5]
    segments = LoRASegments(torch.tensor(order), slot_ids=(2, 0, 1), lengths=(3, 2, 1))
    out = lora_expand(base, lora_shrink(x, lora_a, segments), lora_b, segments)
    expected = base.clone()
    for token, slot in slot_of.items():
        expected[token] += lora_b[slot] @ (lora_a[slot] @ x[token])
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[[2, 4, 6]], base[[2, 4, 6]])


def test_no_segments_leave_the_output_unchanged() -> None:
    segments = LoRASegments(torch.zeros(0, dtype=torch.int64), slot_ids=(), lengths=())
    base = torch.randn(4, 6)
    shrunk = lora_shrink(torch.randn(4, 8), torch.randn(2, 3, 8), segments)
    assert shrunk.shape == (0, 3)
    assert torch.equal(lora_expand(base, shrunk, torch.randn(2, 6, 3), segments), base)

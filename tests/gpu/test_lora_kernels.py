"""Triton LoRA kernels against the per-row loop on CUDA (fp32 and bf16), decode and prefill
mixes with rows that use no adapter."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_reference import lora_segments
from kernels.lora_registry import select_lora_kernels
from tests.unit.kernels.test_lora_reference import per_row_loop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}
# rank 3 x 16 (a packed q/k/v projection) and 16; features as in 1-8B models
SHAPES = ((48, 4096, 6144), (16, 14336, 4096))


def _row_slots(case: str, num_slots: int) -> list[int]:
    if case == "decode":  # 64 decodes, every adapter, every fifth row bare
        return [-1 if row % 5 == 0 else row % num_slots for row in range(64)]
    return [1] * 300 + [-1] * 20 + [0, 3, 2]  # a long prefill beside decodes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rank", "d_in", "d_out"), SHAPES)
@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_triton_lora_matches_per_row_loop(
    dtype: torch.dtype, rank: int, d_in: int, d_out: int, case: str
) -> None:
    kernels = select_lora_kernels("auto", "cuda")
    assert kernels.name == "triton"
    torch.manual_seed(rank)
    num_slots, device = 4, torch.device("cuda")
    row_slots = _row_slots(case, num_slots)
    x = torch.randn(len(row_slots), d_in, device=device).to(dtype)
    a = (torch.randn(num_slots, rank, d_in, device=device) * d_in**-0.5).to(dtype)
    b = (torch.randn(num_slots, d_out, rank, device=device) * rank**-0.5).to(dtype)
    base = torch.randn(len(row_slots), d_out, device=device).to(dtype)
    segments = lora_segments(torch.tensor(row_slots), device)
    assert segments is not None
    got = kernels.expand(base.clone(), kernels.shrink(x, a, segments), b, segments)
    want = per_row_loop(x.float(), a.float(), b.float(), base.float(), row_slots)
    torch.testing.assert_close(got.float(), want, atol=ATOL[dtype], rtol=ATOL[dtype])
    bare = [row for row, slot in enumerate(row_slots) if slot < 0]
    assert torch.equal(got[bare], base[bare])

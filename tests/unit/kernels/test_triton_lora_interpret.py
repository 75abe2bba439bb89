"""Triton LoRA kernels against the per-row loop under the Triton interpreter (CPU tensors).

Each check runs in a fresh subprocess with TRITON_INTERPRET=1 (see test_triton_interpret.py).
"""

from __future__ import annotations

import pytest

from kernels import HAS_TRITON
from tests.unit.kernels.test_triton_interpret import run_interpreted

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

CODE = """
from kernels.lora_reference import lora_segments
from kernels.lora_registry import select_lora_kernels
from tests.unit.kernels.test_lora_reference import per_row_loop
assert select_lora_kernels("auto", "cpu").name == "triton"
kernels = select_lora_kernels("triton", "cpu")
torch.manual_seed(0)
rank, d_in, d_out = 6, 70, 130  # ranks and features not multiples of the blocks
for dtype, atol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
    a = torch.randn(4, rank, d_in).to(dtype)
    b = torch.randn(4, d_out, rank).to(dtype)
    for row_slots in ([2] * 5, [3, -1, 0, 3, -1, 1, 2], [1] * 9 + [-1, 0]):
        x = torch.randn(len(row_slots), d_in).to(dtype)
        base = torch.randn(len(row_slots), d_out).to(dtype)
        segments = lora_segments(torch.tensor(row_slots), torch.device("cpu"))
        got = kernels.expand(base.clone(), kernels.shrink(x, a, segments), b, segments)
        want = per_row_loop(x.float(), a.float(), b.float(), base.float(), row_slots)
        torch.testing.assert_close(got.float(), want, atol=atol * 10, rtol=atol)
        bare = [row for row, slot in enumerate(row_slots) if slot < 0]
        assert torch.equal(got[bare], base[bare])
"""


def test_triton_lora_shrink_and_expand_match_per_row_loop() -> None:
    run_interpreted(CODE, timeout=300)

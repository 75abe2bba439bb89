"""Triton quantized-weight GEMMs against the torch references under the Triton interpreter.

One fresh subprocess with TRITON_INTERPRET=1 (see test_triton_interpret.py) runs every check:
odd N and K (not multiples of the tiles or of the scale blocks), several K and N tiles, int4
group sizes 32 and 128 with and without zero points, experts without tokens, fp32 and 16-bit
activations. Tolerance (max |error| over max |output|): 1e-5 for fp32 activations, 1e-2 for
16-bit ones (the output's own rounding, and bf16 weights in the dot).
"""

from __future__ import annotations

import pytest

from kernels import HAS_TRITON
from tests.unit.kernels.test_triton_interpret import run_interpreted

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

CODE = """
from kernels import quant_reference as ref, triton_quant_fp8, triton_quant_moe
from kernels.quant_testing import (
    expert_offsets, random_fp8_block_weight, random_int4_weight, random_mxfp4_weight)
from kernels.triton_quant_fp8 import Fp8LaunchConfig
from kernels.triton_quant_moe import MoeLaunchConfig

def check(got, want, dtype):
    assert got.dtype == want.dtype == dtype, (got.dtype, want.dtype)
    error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error

torch.manual_seed(0)
SMALL_FP8 = Fp8LaunchConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
SMALL = MoeLaunchConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)

# block-scaled FP8: quantized activations identical to the reference's, then the GEMM
for rows, block, launch in ((5, (128, 128), None), (19, (64, 32), SMALL_FP8)):
    weight = random_fp8_block_weight(70, 200, block, "cpu", seed=rows)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 200).to(dtype)
        got_q, got_s = triton_quant_fp8.quantize_fp8_groups(x, block[1])
        want_q, want_s = ref.quantize_fp8_groups(x, block[1])
        assert torch.equal(got_q.float(), want_q.float()) and torch.equal(got_s, want_s)
        got = triton_quant_fp8.fp8_block_gemm(x, weight.weight, weight.scale_inv, block, launch)
        check(got, ref.fp8_block_gemm(x, weight.weight, weight.scale_inv, block), dtype)

# dense int4 (W4A16), groups 32 / 128, zero points off / on
for group in (32, 128):
    for zero_points in (False, True):
        for dtype, launch in ((torch.float32, SMALL), (torch.float16, None)):
            w = random_int4_weight((37, 200), group, zero_points, dtype, "cpu", seed=group)
            x = torch.randn(19, 200).to(dtype)  # two row tiles of 16
            got = triton_quant_moe.int4_gemm(x, w.qweight, w.scales, w.zeros, group, launch)
            check(got, ref.int4_gemm(x, w.qweight, w.scales, w.zeros, group), dtype)

# MoE: experts without tokens (first, middle, last), a bias, one expert over two row tiles
counts = [0, 3, 0, 18, 1, 0]
offsets = expert_offsets(counts, "cpu")
mx = random_mxfp4_weight(6, 37, 96, "cpu")
q = random_int4_weight((6, 37, 96), 32, True, torch.float32, "cpu")
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(sum(counts), 96).to(dtype)
    bias = torch.randn(6, 37).to(dtype)
    for launch in (SMALL, None):
        got = triton_quant_moe.mxfp4_moe_gemm(x, offsets, mx.blocks, mx.scales, bias, launch)
        check(got, ref.mxfp4_moe_gemm(x, offsets, mx.blocks, mx.scales, bias), dtype)
    got = triton_quant_moe.int4_moe_gemm(x, offsets, q.qweight, q.scales.to(dtype), q.zeros,
                                         32, None, SMALL)
    check(got, ref.int4_moe_gemm(x, offsets, q.qweight, q.scales.to(dtype), q.zeros, 32), dtype)
empty = torch.zeros(0, 96)
none_routed = expert_offsets([0] * 6, "cpu")
assert triton_quant_moe.mxfp4_moe_gemm(empty, none_routed, mx.blocks, mx.scales).shape == (0, 37)
"""


def test_triton_quantized_gemms_match_references() -> None:
    run_interpreted(CODE, timeout=300)

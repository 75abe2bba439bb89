"""The quantized-weight Triton kernels compile to CUDA binaries on a machine without a GPU
(see test_triton_compile.py): the FP8 GEMM on FP8 tensor cores (sm_90), the weight-only
GEMM with bf16 tensor-core dots for MXFP4 experts (sm_90) and dense int4 with zero points
(sm_80)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import HAS_TRITON
from tests.unit.kernels.test_triton_compile import run_compiler

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def test_quantized_gemm_kernels_compile_for_hopper_and_ampere(tmp_path: Path) -> None:
    run_compiler(
        """
        from kernels import triton_quant_fp8, triton_quant_moe
        quantize = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        compile_for(triton_quant_fp8._quantize_fp8_groups_kernel, quantize,
                    dict(GROUP_K=128, FP8_LIMIT=448.0, EPS=1e-10, ROUND_FIRST=False))
        gemm = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv",
                "b_scale_ptr": "*fp32", "c_ptr": "*bf16"}
        tiles = dict(SCALE_ROWS_N=128, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128)
        ptx = compile_for(triton_quant_fp8._fp8_block_gemm_kernel, gemm, tiles)
        assert "e4m3" in ptx and "wgmma" in ptx, "no FP8 tensor cores"
        kernel = triton_quant_moe._weight_only_grouped_kernel
        cases = ((0, "*u8", "*u8", False, 90), (1, "*i32", "*bf16", True, 80))
        for kind, packed, scales, zeros, capability in cases:
            pointers = {"x_ptr": "*bf16", "offsets_ptr": "*i32", "tile_ends_ptr": "*i32",
                        "packed_ptr": packed, "scale_ptr": scales, "zero_ptr": "*u8",
                        "bias_ptr": "*bf16", "out_ptr": "*bf16"}
            constexprs = dict(KIND=kind, GROUP=32, HAS_ZEROS=zeros, SYMMETRIC_ZERO=8,
                              HAS_BIAS=kind == 0, SINGLE_EXPERT=kind == 1, EXPERTS_POW2=32,
                              BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_FP32=False)
            ptx = compile_for(kernel, pointers, constexprs, capability=capability)
            assert "wgmma" in ptx or "mma.sync" in ptx, "no tensor-core instruction"
        """,
        tmp_path,
    )

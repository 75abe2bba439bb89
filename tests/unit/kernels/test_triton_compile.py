"""The Triton kernels compile to CUDA binaries (sm_80, sm_90) on a machine without a GPU.

The interpreter accepts code that the GPU compiler rejects (non-constexpr globals, some
control flow), so the kernels are also compiled ahead of time here, in a subprocess without
TRITON_INTERPRET, with the compiler and ptxas that ship in the triton wheel.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kernels import HAS_TRITON
from tests.helpers.triton_subprocess import run_compiling

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_attention, triton_store_kv

def compile_for(kernel, pointer_types, constexprs, capability=90):
    scalar_types = {"scale": "fp32", "softcap": "fp32", "rope_scaling": "fp32"}
    signature = {
        name: "constexpr" if name in constexprs
        else pointer_types.get(name) or scalar_types.get(name, "i32")
        for name in kernel.arg_names
    }
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32))
    assert compiled.asm["cubin"], kernel.__name__
    return compiled.asm["ptx"]

def attention_pointers(dtype, cache_dtype=None):
    names = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")
    types = {name: dtype for name in names}
    if cache_dtype is not None:
        types.update(k_cache_ptr=cache_dtype, v_cache_ptr=cache_dtype)
    types.update({name: "*fp32" for name in
                  ("part_acc_ptr", "part_max_ptr", "part_sum_ptr", "sinks_ptr",
                   "key_scale_ptr", "inv_freq_ptr", "k_scale_ptr", "v_scale_ptr")})
    types.update({name: "*i32" for name in
                  ("block_table_ptr", "query_start_loc_ptr", "seq_lens_ptr", "key_ends_ptr")})
    return types

def attention_constexprs(group, head_size, block_q, block_n, num_splits, dot_precision="tf32",
                         has_extras=True, rotary_dim=None, kv_fp8=False, block_size=16):
    return dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_SIZE=head_size,
                HEAD_PAD=max(16, triton.next_power_of_2(head_size)), BLOCK_Q=block_q,
                BLOCK_N=block_n, NUM_SPLITS=num_splits, HAS_WINDOW=has_extras,
                HAS_SOFTCAP=has_extras, HAS_SINKS=has_extras,
                KEY_FROM_VALUE=rotary_dim is not None, ROTARY_DIM=rotary_dim or 2,
                DOT_FP32=False, DOT_PRECISION=dot_precision, KV_FP8=kv_fp8,
                HAS_KEY_ENDS=has_extras, BLOCK_SIZE=block_size)

def store_constexprs(kv_fp8=None):
    fp8 = dict(KV_FP8=False, FP8_MAX=1.0, MANTISSA_BITS=0, MIN_STEP_EXP=0)
    if kv_fp8 is not None:
        fp8 = dict(KV_FP8=True, FP8_MAX=kv_fp8.max, MANTISSA_BITS=kv_fp8.mantissa_bits,
                   MIN_STEP_EXP=kv_fp8.min_step_exp)
    return dict(NUM_HEADS=8, HEADS_PAD=8, HEAD_SIZE=128, HEAD_PAD=128, **fp8)
"""


def run_compiler(code: str, cache_dir: Path) -> None:
    """Run `PRELUDE + code` in a fresh Python without the interpreter; fail with its stderr."""
    run_compiling(PRELUDE, code, cache_dir)


def test_attention_kernels_compile_for_hopper_and_ampere_with_tensor_cores(
    tmp_path: Path,
) -> None:
    run_compiler(
        """
        kernel = triton_attention._paged_attention_kernel
        prefill = attention_constexprs(group=4, head_size=128, block_q=16, block_n=64,
                                       num_splits=1)
        ptx = compile_for(kernel, attention_pointers("*bf16"), prefill)
        assert "wgmma" in ptx or "mma.sync" in ptx, "no tensor-core instruction"
        # key tiles inside one 64-token block: one block-table lookup per tile
        paged64 = attention_constexprs(group=4, head_size=128, block_q=32, block_n=64,
                                       num_splits=1, has_extras=False, block_size=64)
        compile_for(kernel, attention_pointers("*bf16"), paged64)
        decode = attention_constexprs(group=8, head_size=80, block_q=2, block_n=64, num_splits=8)
        ptx = compile_for(kernel, attention_pointers("*fp16"), decode, capability=80)
        assert "mma.sync" in ptx, "no tensor-core instruction"
        wide = attention_constexprs(group=8, head_size=512, block_q=2, block_n=16, num_splits=1)
        compile_for(kernel, attention_pointers("*bf16"), wide)
        keys_from_values = attention_constexprs(group=8, head_size=512, block_q=2, block_n=16,
                                                num_splits=4, rotary_dim=512)
        compile_for(kernel, attention_pointers("*bf16"), keys_from_values)
        fp32 = attention_constexprs(group=2, head_size=64, block_q=8, block_n=32,
                                    num_splits=1, dot_precision="ieee", has_extras=False)
        compile_for(kernel, attention_pointers("*fp32"), fp32)
        # fp8 KV pages (small tiles: each compile costs seconds): keys loaded, then rebuilt
        # from the values (K = V)
        fp8 = attention_constexprs(group=4, head_size=64, block_q=4, block_n=16, num_splits=1,
                                   kv_fp8=True)
        compile_for(kernel, attention_pointers("*bf16", "*fp8e4nv"), fp8)
        fp8 = attention_constexprs(group=4, head_size=64, block_q=4, block_n=16, num_splits=1,
                                   has_extras=False, rotary_dim=32, kv_fp8=True)
        compile_for(kernel, attention_pointers("*bf16", "*fp8e5"), fp8)
        merge_pointers = {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32",
                          "part_sum_ptr": "*fp32"}
        compile_for(triton_attention._merge_splits_kernel, merge_pointers,
                    dict(HEAD_SIZE=96, HEAD_PAD=128, NUM_SPLITS=16))
        """,
        tmp_path,
    )


def test_store_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    run_compiler(
        """
        pointers = {name: "*bf16" for name in ("key_ptr", "value_ptr", "k_cache_ptr",
                                                "v_cache_ptr")}
        pointers["slot_mapping_ptr"] = "*i64"
        pointers.update(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
        compile_for(triton_store_kv._store_kv_kernel, pointers, store_constexprs())
        import torch
        from kernels.kv_quant import fp8_format
        for cache, dtype in (("*fp8e4nv", torch.float8_e4m3fn), ("*fp8e5", torch.float8_e5m2)):
            pointers.update(k_cache_ptr=cache, v_cache_ptr=cache)
            ptx = compile_for(triton_store_kv._store_kv_kernel, pointers,
                              store_constexprs(fp8_format(dtype)))
            # The round-to-nearest-even of the store (x + 1.5 * 2**23 - 1.5 * 2**23) survives.
            assert "0f4B400000" in ptx, "the fp8 rounding was optimized away"
        """,
        tmp_path,
    )


def test_mamba_conv_decode_kernel_compiles_for_hopper(tmp_path: Path) -> None:
    run_compiler(
        """
        from kernels import triton_mamba
        pointers = {name: "*bf16" for name in ("x_ptr", "w_ptr", "b_ptr", "init_ptr", "out_ptr",
                                                "final_ptr")}
        constexprs = dict(WIDTH=4, HAS_BIAS=True, SILU=True, BLOCK_D=256)
        compile_for(triton_mamba._conv_decode_kernel, pointers, constexprs)
        """,
        tmp_path,
    )

"""Triton `store_kv_cache`: scatter new K/V rows into the paged cache through `slot_mapping`.

One program per token copies its `[num_kv_heads, head_size]` key and value rows. The caches
may be strided views into a shared buffer; only each row of `head_size` must be contiguous.
fp8 caches store `clamp(x / scale)` in fp32 before the cast, as `kernels.kv_quant.quantize`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import Fp8Format, KVScales, fp8_format, is_fp8, scale_tensors
from kernels.reference import check_store_args

_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + it - it rounds |x| < 2**22 to an integer


@triton.jit  # type: ignore[untyped-decorator]
def _round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr):  # type: ignore[no-untyped-def]
    # fp32 x (already clamped) rounded to the nearest fp8 value, ties to even, so that the cast
    # after it is exact whatever rounding the cast would do (the interpreter's is not RTNE).
    # Spacing of fp8 values near x: 2^(exponent of x - MANTISSA_BITS), at least the subnormal
    # step 2^MIN_STEP_EXP; built as an fp32 power of two from its biased exponent.
    exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step_exp = tl.maximum(exponent - MANTISSA_BITS, MIN_STEP_EXP + 127)
    step = (step_exp << 23).to(tl.float32, bitcast=True)
    return ((x / step + _ROUNDER) - _ROUNDER) * step


@triton.jit  # type: ignore[untyped-decorator]
def _to_cache(  # type: ignore[no-untyped-def]
    x, scale_ptr, cache_ptr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr, MIN_STEP_EXP: tl.constexpr,
):  # fmt: skip
    # fp8: clamp(x / scale) in fp32, rounded to nearest even, then the (exact) cast.
    if KV_FP8:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
        x = _round_to_fp8_grid(x, MANTISSA_BITS, MIN_STEP_EXP)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit  # type: ignore[untyped-decorator]
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    block_size, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MIN_STEP_EXP: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_SIZE)

    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    k_dst = k_cache_ptr + block_id * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    key = _to_cache(key, k_scale_ptr, k_cache_ptr, KV_FP8, FP8_MAX, MANTISSA_BITS, MIN_STEP_EXP)
    tl.store(k_dst, key, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    v_dst = v_cache_ptr + block_id * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    value = _to_cache(value, v_scale_ptr, v_cache_ptr, KV_FP8, FP8_MAX, MANTISSA_BITS, MIN_STEP_EXP)
    tl.store(v_dst, value, mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_size]` into the caches in place.

    Same contract as `kernels.reference.store_kv_cache`: slot -1 skips a token, fp8 caches
    are quantized with `kv_scales` (1.0 when None).
    """
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    for tensor in (key, value, key_cache, value_cache):
        assert tensor.stride(-1) == 1, "head_size must be contiguous"
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    is_quantized = is_fp8(key_cache.dtype)
    fp8 = fp8_format(key_cache.dtype) if is_quantized else Fp8Format(1.0, 0, 0)
    k_scale, v_scale = scale_tensors(kv_scales, key.device)
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(), k_scale, v_scale,
        key_cache.shape[1], key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size),
        KV_FP8=is_quantized, FP8_MAX=fp8.max, MANTISSA_BITS=fp8.mantissa_bits,
        MIN_STEP_EXP=fp8.min_step_exp,
    )  # fmt: skip

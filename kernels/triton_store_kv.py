"""Triton `store_kv_cache`: scatter new K/V rows into the paged cache through `slot_mapping`.

One program per token copies its `[num_kv_heads, head_size]` key and value rows. The caches
may be strided views into a shared buffer; only each row of `head_size` must be contiguous.
fp8 caches store `clamp(x / scale)` in fp32 before the cast, as `kernels.kv_quant.quantize`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import KVScales, fp8_max, is_fp8, scale_tensors
from kernels.reference import check_store_args


@triton.jit  # type: ignore[untyped-decorator]
def _to_cache(x, scale_ptr, cache_ptr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):  # type: ignore[no-untyped-def]
    # fp8: clamp(x / scale) in fp32, then the cast (round to nearest even).
    if KV_FP8:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit  # type: ignore[untyped-decorator]
def _store_kv_kernel(  # type: ignore[no-untyped-def]
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    block_size, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
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
    tl.store(k_dst, _to_cache(key, k_scale_ptr, k_cache_ptr, KV_FP8, FP8_MAX), mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    v_dst = v_cache_ptr + block_id * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    tl.store(v_dst, _to_cache(value, v_scale_ptr, v_cache_ptr, KV_FP8, FP8_MAX), mask=mask)


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
    k_scale, v_scale = scale_tensors(kv_scales, key.device)
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping.contiguous(), k_scale, v_scale,
        key_cache.shape[1], key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size),
        KV_FP8=is_quantized, FP8_MAX=fp8_max(key_cache.dtype) if is_quantized else 1.0,
    )  # fmt: skip

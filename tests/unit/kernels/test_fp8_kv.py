"""fp8 KV pages: the store rule, and the torch kernels reading fp8 pages with their scales.

The oracle of a kernel over fp8 pages is the reference over fp32 caches holding what those pages
read as (`fp8.float() * scale`): the reference must equal it exactly, the batched kernel within
1e-5 (fp32 sums in another order). Pages come from `make_fp8_batch` (NaN poison in every slot
no request may read, scales far from 1). Triton is checked in test_triton_fp8_interpret.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels import batched_attention, reference, select_backend
from kernels import flash_attn as flash_attn_adapter
from kernels.kv_quant import (
    KVScales,
    dequantize,
    fp8_format,
    fp8_max,
    kv_cache_torch_dtype,
    quantize,
)
from tests.helpers.fp8_kv_batches import dequantized_batch, kv_scales, make_fp8_batch
from tests.helpers.kernel_batches import BatchSpec, PagedBatch, make_key_from_value
from worker.attention.metadata_transforms import make_virtual_batches

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# decode, fresh prefill, chunked prefill, empty query, one-token request, decodes
MIXED = ((1, 37), (13, 13), (5, 22), (0, 9), (1, 1), (7, 40), (1, 16), (3, 16))
SCALE = 0.3
SINKS = torch.linspace(-2.0, 3.0, 8)


def _outputs(batch: PagedBatch, scales: KVScales, **kwargs: object) -> dict[str, torch.Tensor]:
    """The reference over the dequantized caches, and each torch kernel over the fp8 pages."""
    fp8_args = batch.kernel_args(SCALE)
    oracle_args = dequantized_batch(batch, scales).kernel_args(SCALE)
    return {
        "oracle": reference.paged_attention(*oracle_args, **kwargs),  # type: ignore[arg-type]
        "reference": reference.paged_attention(*fp8_args, **kwargs, kv_scales=scales),  # type: ignore[arg-type]
        "batched": batched_attention.paged_attention(*fp8_args, **kwargs, kv_scales=scales),  # type: ignore[arg-type]
    }


def _assert_kernels_match(batch: PagedBatch, scales: KVScales, **kwargs: object) -> None:
    out = _outputs(batch, scales, **kwargs)
    assert out["oracle"].isfinite().all(), "a kernel read NaN poison or overflowed"
    torch.testing.assert_close(out["reference"], out["oracle"], atol=0.0, rtol=0.0)
    torch.testing.assert_close(out["batched"], out["oracle"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", FP8)
def test_store_then_read_is_within_fp8_precision_and_applies_the_scales(
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(0)
    # |x| <= 4 stays in range: 4 / 0.01 < 448 (e4m3's largest)
    key, value = torch.randn(2, 12, 2, 16, generator=gen).clamp(-4.0, 4.0)
    key_cache = torch.full((4, 4, 2, 16), float("nan")).to(dtype)
    value_cache = key_cache.clone()
    slots = torch.tensor([5, -1, 0, 15, 3, 8, 9, 10, 11, 1, 2, -1])
    scales = kv_scales()
    reference.store_kv_cache(key, value, key_cache, value_cache, slots, scales)
    kept = slots >= 0
    for rows, cache, scale in ((key, key_cache, scales.key), (value, value_cache, scales.value)):
        read = dequantize(cache.flatten(0, 1)[slots[kept]], scale)
        # Half an fp8 step of |x|, or half the smallest subnormal step near 0.
        tolerance = rows[kept].abs() * 2.0 ** -(fp8_format(dtype).mantissa_bits + 1)
        tolerance = tolerance.clamp(min=float(scale) * torch.finfo(dtype).smallest_normal)
        assert ((read - rows[kept]).abs() <= tolerance).all()
        unused = torch.tensor([4, 6, 7, 12, 13, 14])
        assert cache.flatten(0, 1)[unused].float().isnan().all(), "other slots stay untouched"


@pytest.mark.parametrize("dtype", FP8)
def test_store_clamps_to_the_fp8_range_instead_of_overflowing(dtype: torch.dtype) -> None:
    scale = torch.tensor(0.5)
    huge = torch.tensor([1e9, -1e9, 3.0])
    stored = quantize(huge, scale, dtype)
    assert stored.float().tolist() == [fp8_max(dtype), -fp8_max(dtype), 6.0]
    assert quantize(huge, scale, torch.float32).tolist() == huge.tolist()


def test_kv_cache_dtype_names() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) is torch.float8_e5m2


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("interleaved", [False, True])
def test_kernels_read_fp8_pages_with_gqa(dtype: torch.dtype, interleaved: bool) -> None:
    spec = BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, is_interleaved=interleaved)
    _assert_kernels_match(*make_fp8_batch(spec, dtype, seed=1))


@pytest.mark.parametrize("dtype", FP8)
def test_sliding_window_sinks_and_softcap_on_fp8_pages_stay_finite(dtype: torch.dtype) -> None:
    spec = BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, sliding_window=6)
    batch, scales = make_fp8_batch(spec, dtype, seed=2)
    _assert_kernels_match(batch, scales, sliding_window=6, softcap=2.5, sinks=SINKS)


@pytest.mark.parametrize("dtype", FP8)
def test_keys_rebuilt_from_fp8_values_use_the_value_scale(dtype: torch.dtype) -> None:
    spec = BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, sliding_window=7)
    batch, scales = make_fp8_batch(spec, dtype, seed=3)
    batch.key_cache.fill_(float("nan"))  # K = V: the key pages are never read
    derive = make_key_from_value(spec.head_size, 12, 2)
    k_equals_v = KVScales(scales.value, scales.value)
    _assert_kernels_match(batch, k_equals_v, sliding_window=7, key_from_value=derive)


def test_chunked_local_virtual_batches_on_fp8_pages() -> None:
    spec = BatchSpec(MIXED, num_q_heads=4, num_kv_heads=2, block_size=4)
    batch, scales = make_fp8_batch(spec, seed=4)
    virtual = make_virtual_batches(
        batch.query_start_loc, batch.seq_lens, batch.block_table, chunk_size=8, block_size=4
    )
    chunked = PagedBatch(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        virtual.block_table,
        virtual.query_start_loc,
        virtual.seq_lens,
        batch.keys,
        batch.values,
    )
    _assert_kernels_match(chunked, scales)


def test_scales_change_the_output() -> None:
    """A kernel that ignored the scales would read pages about 50x too large."""
    batch, scales = make_fp8_batch(BatchSpec(MIXED), seed=5)
    unscaled = batched_attention.paged_attention(*batch.kernel_args(SCALE))
    scaled = batched_attention.paged_attention(*batch.kernel_args(SCALE), kv_scales=scales)
    assert (unscaled - scaled).abs().max() > 0.1


def test_flash_attn_refuses_fp8_pages_and_auto_keeps_a_kernel_that_reads_them() -> None:
    reason = flash_attn_adapter.unsupported_reason(
        torch.device("cuda"), 256, 128, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn
    )
    assert reason is not None
    assert "float8_e4m3fn" in reason
    with pytest.raises(ValueError, match="float16/bfloat16 KV pages only"):
        select_backend(
            "flash_attn",
            device="cpu",
            block_size=256,
            head_size=128,
            kv_cache_dtype=torch.float8_e5m2,
        )
    auto = select_backend(
        "auto", device="cpu", block_size=16, head_size=64, kv_cache_dtype=torch.float8_e4m3fn
    )
    assert auto.paged_attention is batched_attention.paged_attention

"""fp8 versions of the kernel test batches: the same paged K/V stored through the fp8 rule.

`make_fp8_batch` quantizes the caches of `make_paged_batch` (NaN poison stays NaN, strided
views stay strided) with given key and value scales, and `dequantized_batch` reads the fp8
pages back into fp32 caches: the reference over those (without scales) is what every kernel
over the fp8 pages must reproduce.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kernels.kv_quant import KVScales, dequantize, quantize
from tests.helpers.kernel_batches import BatchSpec, PagedBatch, make_paged_batch

KEY_SCALE = 0.02
VALUE_SCALE = 0.01
"""Scales far from 1 (random K/V of std 1 are stored as fp8 values of about 50 to 100), so a
kernel that ignores one is far off."""


def kv_scales(device: torch.device | str = "cpu") -> KVScales:
    """The test scales as fp32 scalar tensors."""
    return KVScales(
        torch.tensor(KEY_SCALE, device=device), torch.tensor(VALUE_SCALE, device=device)
    )


def make_fp8_batch(
    spec: BatchSpec,
    dtype: torch.dtype = torch.float8_e4m3fn,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[PagedBatch, KVScales]:
    """A `make_paged_batch` batch whose caches hold fp8 pages, and the scales they were
    stored with (`keys`/`values` stay the original fp32 rows)."""
    batch = make_paged_batch(spec, seed=seed, device=device)
    scales = kv_scales(device)
    raw = _raw_buffer(batch.key_cache, batch.value_cache, spec.is_interleaved)
    key_pages = quantize(batch.key_cache, scales.key, dtype)
    value_pages = quantize(batch.value_cache, scales.value, dtype)
    fp8 = torch.empty(raw.shape, dtype=dtype, device=raw.device)
    key_cache, value_cache = (fp8[:, 0], fp8[:, 1]) if spec.is_interleaved else (fp8[0], fp8[1])
    key_cache.copy_(key_pages)
    value_cache.copy_(value_pages)
    return replace(batch, key_cache=key_cache, value_cache=value_cache), scales


def dequantized_batch(batch: PagedBatch, scales: KVScales) -> PagedBatch:
    """The same batch with fp32 caches holding what its fp8 pages read as."""
    return replace(
        batch,
        key_cache=dequantize(batch.key_cache, scales.key),
        value_cache=dequantize(batch.value_cache, scales.value),
    )


def _raw_buffer(
    key_cache: torch.Tensor, value_cache: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """The stacked shape both caches view ([blocks, 2, ...] interleaved, else [2, blocks, ...])."""
    return torch.stack((key_cache, value_cache), dim=1 if interleaved else 0)

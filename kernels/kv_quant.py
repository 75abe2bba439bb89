"""fp8 KV cache pages: the one rule every backend follows to store and to read them.

A layer has a key scale and a value scale (fp32 scalars, default 1.0). Storing into an fp8
cache writes `clamp(x / scale, -fp8_max, fp8_max)` cast to fp8 (round to nearest even);
reading gives `fp8.float() * scale`. Caches in any other dtype ignore the scales. The Triton
kernels spell the same arithmetic in fp32 (the torch reference is their oracle).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""`kv_cache_dtype` names (vLLM's) of fp8 pages -> their element type."""


class KVScales(NamedTuple):
    """One layer's dequantization scales, fp32 scalar tensors on the cache's device."""

    key: torch.Tensor
    value: torch.Tensor


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Element type of attention KV pages for `kv_cache_dtype` `name` ("auto": the model's)."""
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(FP8_KV_DTYPES)}")
    return FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether caches of `dtype` hold fp8 values that the scales apply to."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of the fp8 `dtype` (448 for e4m3fn, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


class Fp8Format(NamedTuple):
    """What a kernel needs to round to an fp8 dtype by itself."""

    max: float
    mantissa_bits: int
    min_step_exp: int
    """Spacing of the subnormals is 2**min_step_exp (-9 for e4m3fn, -16 for e5m2)."""


def fp8_format(dtype: torch.dtype) -> Fp8Format:
    """The `Fp8Format` of an fp8 `dtype`."""
    mantissa_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype]
    min_normal_exp = int(math.log2(torch.finfo(dtype).smallest_normal))
    return Fp8Format(fp8_max(dtype), mantissa_bits, min_normal_exp - mantissa_bits)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`x` as stored in a cache of `dtype`: scaled, clamped and cast when fp8, else cast."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = fp8_max(dtype)
    scaled = x.float() if scale is None else x.float() / scale.float()
    return scaled.clamp(-limit, limit).to(dtype)


def dequantize(pages: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of cache `pages`: times `scale` when they are fp8."""
    values = pages.float()
    if scale is None or not is_fp8(pages.dtype):
        return values
    return values * scale.float()


def scale_of_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`amax / fp8_max`, or 1.0 where `amax` is 0 or not finite (a scale is never 0): vLLM's
    per-layer `calculate_kv_scales` rule, with no device sync."""
    is_usable = (amax > 0) & amax.isfinite()
    return torch.where(is_usable, amax / fp8_max(dtype), torch.ones_like(amax))


def split_scales(kv_scales: KVScales | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(key scale, value scale), None each when no scales are given."""
    if kv_scales is None:
        return None, None
    return kv_scales.key, kv_scales.value


def scale_tensors(
    kv_scales: KVScales | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 key and value scales as kernel arguments (ones when no scales are given)."""
    if kv_scales is None:
        ones = torch.ones(1, dtype=torch.float32, device=device)
        return ones, ones
    return kv_scales.key.float(), kv_scales.value.float()

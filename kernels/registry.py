"""Attention backend registry: pick torch, Triton or flash-attn kernels once, at worker start.

`select_backend("auto", ...)` prefers flash-attn, then Triton, on CUDA and the batched torch
kernel ("torch": all decodes of a step in a few gathers and batched products) on CPU, and logs
why; on CPU it beats the per-request reference end to end in fp32 and in bf16
(docs/benchmarks.md). "reference" is the per-request torch path, the oracle every other backend
is tested against. "batch_invariant" (the batch-invariant mode's; never picked by "auto") gives
each query row the same arithmetic whatever the batch (`kernels.batch_invariant_attention`),
on any device. Kernel modules are imported only when selected. fp8 KV pages
(`kernels.kv_quant`) are read by every backend but flash-attn 2, which `auto` then skips.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kernels.kv_quant import KVScales
    from kernels.reference import KeyFromValue

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "triton", "flash_attn", "torch", "reference", "batch_invariant")


class StoreKVCacheFn(Protocol):
    """`store_kv_cache(key, value, key_cache, value_cache, slot_mapping, kv_scales)`: writes
    the caches (fp8 caches quantized with `kv_scales`)."""

    def __call__(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVScales | None = None,
    ) -> None: ...


class PagedAttentionFn(Protocol):
    """`paged_attention(...)` over a mixed batch; see `kernels.reference.paged_attention`."""

    def __call__(  # noqa: PLR0913 (the signature shared by every backend)
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        key_from_value: KeyFromValue | None = None,
        kv_scales: KVScales | None = None,
        key_ends: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class AttentionBackend:
    """The two kernels a worker calls, from one backend."""

    name: str
    store_kv_cache: StoreKVCacheFn
    paged_attention: PagedAttentionFn


@dataclass(frozen=True)
class _Request:
    device: torch.device
    block_size: int
    head_size: int
    dtype: torch.dtype | None
    has_sinks: bool = False
    keys_from_values: bool = False
    kv_cache_dtype: torch.dtype | None = None


@functools.cache
def triton_import_error() -> str | None:
    """Why `triton` cannot be imported, or None when it can."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # missing, or a broken install
        return f"triton does not import ({type(exc).__name__}: {exc})"
    return None


def select_backend(  # noqa: PLR0913 (the cache layout, then what the layers need)
    name: str = "auto",
    *,
    device: str | torch.device,
    block_size: int,
    head_size: int,
    dtype: torch.dtype | None = None,
    has_sinks: bool = False,
    keys_from_values: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend `name` (one of `BACKEND_NAMES`) for this device and cache layout.

    `has_sinks`: the layers pass per-head sink logits; `keys_from_values`: they pass a
    `KeyFromValue` (one stored tensor); `kv_cache_dtype`: the pages' element type when it is
    not `dtype` (fp8). Not every backend supports each.
    Raises ValueError naming the reason when an explicitly requested backend is unavailable.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    request = _Request(
        torch.device(device),
        block_size,
        head_size,
        dtype,
        has_sinks,
        keys_from_values,
        kv_cache_dtype,
    )
    if name == "auto":
        return _select_auto(request)
    reason = _unavailable_reason(name, request)
    if reason is not None:
        raise ValueError(f"attention backend {name!r} is unavailable: {reason}")
    logger.info("attention backend %s (requested explicitly)", name)
    return _build(name)


def _select_auto(request: _Request) -> AttentionBackend:
    if request.device.type != "cuda":
        logger.info("attention backend torch (batched): device is %s", request.device.type)
        return _build("torch")
    for name in ("flash_attn", "triton"):
        reason = _unavailable_reason(name, request)
        if reason is None:
            logger.info("attention backend %s: available on %s", name, request.device)
            return _build(name)
        logger.info("attention backend %s skipped: %s", name, reason)
    logger.warning("attention backend torch on CUDA: no GPU kernel backend is available")
    return _build("torch")


def _unavailable_reason(name: str, request: _Request) -> str | None:
    if name in ("torch", "reference", "batch_invariant"):
        return None
    if name == "flash_attn":
        from kernels import flash_attn

        return flash_attn.unsupported_reason(
            request.device,
            request.block_size,
            request.head_size,
            request.dtype,
            has_sinks=request.has_sinks,
            keys_from_values=request.keys_from_values,
            kv_cache_dtype=request.kv_cache_dtype,
        )
    return _triton_unavailable_reason(request)


def _triton_unavailable_reason(request: _Request) -> str | None:
    error = triton_import_error()
    if error is not None:
        return error
    if request.head_size > 512:
        return f"the Triton kernel supports head_size <= 512, got {request.head_size}"
    reason = triton_device_reason(request.device)
    if reason is None and request.kv_cache_dtype == torch.float8_e4m3fn:
        return _triton_e4m3_reason(request.device)
    return reason


def _triton_e4m3_reason(device: torch.device) -> str | None:
    """Triton has float8_e4m3fn (its fp8e4nv) on compute capability 8.9 and later only."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
        return None
    return "Triton reads float8_e4m3fn pages on compute capability >= 8.9 only (try fp8_e5m2)"


def triton_device_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on `device` (None: CUDA, or CPU under the interpreter)."""
    error = triton_import_error()
    if error is not None:
        return error
    if device.type == "cuda":
        return None
    from kernels import triton_attention

    if device.type == "cpu" and triton_attention.is_interpreted():
        return None
    return (
        f"Triton kernels need a CUDA device, not {device.type}; on CPU they run only "
        "when TRITON_INTERPRET=1 is set before triton is imported (slow; meant for tests)"
    )


def _build(name: str) -> AttentionBackend:
    from kernels import reference

    if name == "reference":
        return AttentionBackend(name, reference.store_kv_cache, reference.paged_attention)
    if name == "batch_invariant":
        from kernels import batch_invariant_attention as invariant

        return AttentionBackend(name, reference.store_kv_cache, invariant.paged_attention)
    if name == "torch":
        from kernels import batched_attention

        return AttentionBackend(name, reference.store_kv_cache, batched_attention.paged_attention)
    if name == "triton":
        from kernels import triton_attention, triton_store_kv

        return AttentionBackend(
            name, triton_store_kv.store_kv_cache, triton_attention.paged_attention
        )
    from kernels import flash_attn

    store: StoreKVCacheFn = reference.store_kv_cache  # flash-attn has no cache-store kernel
    if triton_import_error() is None:
        from kernels import triton_store_kv

        store = triton_store_kv.store_kv_cache
    return AttentionBackend(name, store, flash_attn.paged_attention)

"""Adapter over the optional flash-attn package: varlen attention with a paged KV cache.

flash-attn builds only for CUDA and is imported on first use. `unsupported_reason` says
why it cannot serve a configuration (the registry logs that reason and falls back).

fp8 KV pages are refused: flash-attn 2 reads fp16/bf16 pages only, and dequantizing every
page a step reads into a temporary would move 2.5x the bytes of reading fp8 in the kernel
(read fp8, write and read bf16), so `auto` picks Triton, which dequantizes as it loads.

Per-row key ends (an image's tokens attending to each other both ways, Gemma 3) are served by
handing that call to the Triton kernel: flash-attn 2 has causal or full masks only. Only the
steps that prefill such an image carry them; every other step stays on flash-attn.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from kernels.kv_quant import KVScales, is_fp8
from kernels.reference import KeyFromValue, check_attention_args

_PAGED_BLOCK_MULTIPLE = 256  # flash-attn 2 rejects paged KV blocks of other sizes
_MAX_HEAD_SIZE = 256
_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def import_error() -> str | None:
    """Why `flash_attn` cannot be used at all, or None when it imports with paged varlen."""
    try:
        module = importlib.import_module("flash_attn")
    except Exception as exc:  # a broken CUDA build raises ImportError or OSError
        return f"flash-attn does not import ({type(exc).__name__}: {exc})"
    varlen = getattr(module, "flash_attn_varlen_func", None)
    if varlen is None:
        return "flash-attn has no flash_attn_varlen_func"
    parameters = inspect.signature(varlen).parameters
    missing = [name for name in ("block_table", "softcap", "window_size") if name not in parameters]
    if missing:
        version = getattr(module, "__version__", "?")
        return f"flash-attn {version} lacks {', '.join(missing)} in flash_attn_varlen_func"
    return None


def unsupported_reason(  # noqa: PLR0913 (the cache layout, then what the layers need)
    device: torch.device,
    block_size: int,
    head_size: int,
    dtype: torch.dtype | None = None,
    *,
    has_sinks: bool = False,
    keys_from_values: bool = False,
    kv_cache_dtype: torch.dtype | None = None,
) -> str | None:
    """Why flash-attn cannot run this configuration, or None when it can."""
    if kv_cache_dtype is not None and is_fp8(kv_cache_dtype):
        return f"flash-attn 2 reads float16/bfloat16 KV pages only, not {kv_cache_dtype}"
    if has_sinks:
        return "flash-attn 2 has no attention sinks (per-head logits in the softmax denominator)"
    if keys_from_values:
        return "flash-attn reads stored keys; it cannot derive them from the cached values"
    if device.type != "cuda":
        return f"flash-attn needs a CUDA device, not {device.type}"
    if block_size % _PAGED_BLOCK_MULTIPLE != 0:
        return (
            f"flash-attn 2 paged KV needs block_size % {_PAGED_BLOCK_MULTIPLE} == 0, "
            f"got {block_size}"
        )
    if head_size % 8 != 0 or head_size > _MAX_HEAD_SIZE:
        return f"flash-attn needs head_size % 8 == 0 and <= {_MAX_HEAD_SIZE}, got {head_size}"
    if dtype is not None and dtype not in _DTYPES:
        return f"flash-attn supports float16 and bfloat16 only, got {dtype}"
    return import_error()


def paged_attention(  # noqa: PLR0913 (the signature shared by every backend)
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
) -> torch.Tensor:
    """Paged attention of a mixed batch; same contract as `kernels.reference.paged_attention`
    (fp8 caches are refused: `kv_scales` is there for the shared signature; a call with
    `key_ends` runs the Triton kernel).

    NOTE: reads `max(q_len)` and `max(seq_len)` on the host (one device sync), as
    flash-attn's varlen API needs them. flash-attn starts its key loop at the window's first
    block, so stale block-table entries before the window are not dereferenced.
    """
    check_attention_args(query, key_cache, value_cache, block_table, sliding_window, softcap, sinks)
    if key_ends is not None:
        from kernels import triton_attention

        return triton_attention.paged_attention(
            query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale,
            sliding_window, softcap, sinks, key_from_value, kv_scales, key_ends,
        )  # fmt: skip
    reason = unsupported_reason(
        query.device,
        key_cache.shape[1],
        query.shape[2],
        query.dtype,
        has_sinks=sinks is not None,
        keys_from_values=key_from_value is not None,
        kv_cache_dtype=key_cache.dtype,
    )
    if reason is not None:
        raise ValueError(reason)
    if seq_lens.numel() == 0 or query.shape[0] == 0:
        return torch.empty_like(query)
    from flash_attn import flash_attn_varlen_func

    cu_seqlens_k = torch.nn.functional.pad(seq_lens.cumsum(0), (1, 0)).to(torch.int32)
    max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
    output: torch.Tensor = flash_attn_varlen_func(
        query,
        key_cache,
        value_cache,
        cu_seqlens_q=query_start_loc.to(torch.int32),
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_query_len,
        max_seqlen_k=int(seq_lens.max()),
        softmax_scale=scale,
        causal=True,
        window_size=window,
        softcap=0.0 if softcap is None else softcap,
        block_table=block_table.to(torch.int32),
    )
    return output

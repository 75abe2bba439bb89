"""Attention kernels over a paged KV cache: torch reference, Triton and flash-attn backends.

Importing this package loads neither triton nor flash-attn; `HAS_TRITON` and
`HAS_FLASH_ATTN` probe them on first access. Workers choose a backend once with
`select_backend` and call its `store_kv_cache` and `paged_attention`.
"""

from __future__ import annotations

from kernels.registry import (
    BACKEND_NAMES,
    AttentionBackend,
    PagedAttentionFn,
    StoreKVCacheFn,
    select_backend,
)

__all__ = [
    "BACKEND_NAMES",
    "HAS_FLASH_ATTN",
    "HAS_TRITON",
    "AttentionBackend",
    "PagedAttentionFn",
    "StoreKVCacheFn",
    "select_backend",
]


def __getattr__(name: str) -> bool:
    """Availability flags, probed lazily so that `import kernels` stays light."""
    if name == "HAS_TRITON":
        from kernels.registry import triton_import_error

        return triton_import_error() is None
    if name == "HAS_FLASH_ATTN":
        from kernels.flash_attn import import_error

        return import_error() is None
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""GPU kernels (Triton, flash-attn) against the torch reference in fp16/bf16 over a shape grid.

`make test-gpu` installs the gpu extra and sets REQUIRE_FLASH_ATTN=1: a flash-attn that does not
import then fails the flash-attn tests instead of skipping them.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from kernels import reference, select_backend
from kernels.reference import KeyFromValue
from tests.helpers.kernel_batches import (
    BatchSpec,
    PagedBatch,
    allocate_caches,
    make_key_from_value,
    make_paged_batch,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# decode, fresh prefill, chunked prefill after a prefix, empty query, long decode
MIXED = ((1, 300), (77, 77), (40, 530), (0, 20), (1, 1), (1, 2049), (129, 200))
HEADS = [(8, 8), (32, 8), (16, 1)]  # (num_q_heads, num_kv_heads)
ATOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}
SCALE = 0.1


def run_backend(
    name: str,
    batch: PagedBatch,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    key_from_value: KeyFromValue | None = None,
) -> torch.Tensor:
    backend = select_backend(
        name,
        device="cuda",
        block_size=batch.key_cache.shape[1],
        head_size=batch.query.shape[2],
        dtype=batch.query.dtype,
        has_sinks=sinks is not None,
        keys_from_values=key_from_value is not None,
    )
    return backend.paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.query_start_loc,
        batch.seq_lens,
        SCALE,
        window,
        softcap,
        sinks,
        key_from_value,
    )


def assert_matches_reference(
    name: str, spec: BatchSpec, window: int | None = None, softcap: float | None = None
) -> None:
    batch = make_paged_batch(spec, seed=0, device="cuda")
    got = run_backend(name, batch, window, softcap)
    want = run_backend("torch", batch, window, softcap)
    assert got.dtype == spec.dtype
    torch.testing.assert_close(got, want, atol=ATOL[spec.dtype], rtol=ATOL[spec.dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "head_size", "block_size"),
    [
        *itertools.product(HEADS, [64, 80, 96, 128, 256, 512], [16]),
        ((32, 8), 128, 1),
        ((8, 2), 64, 5),
    ],
)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (100, 30.0)])
def test_triton_matches_reference(
    dtype: torch.dtype,
    heads: tuple[int, int],
    head_size: int,
    block_size: int,
    window: int | None,
    softcap: float | None,
) -> None:
    num_q_heads, num_kv_heads = heads
    spec = BatchSpec(
        MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        sliding_window=window,
        is_interleaved=block_size == 16,
    )
    assert_matches_reference("triton", spec, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_size", "window"), [(64, 128), (64, None), (512, 1024)])
def test_triton_with_sinks_matches_reference(
    dtype: torch.dtype, head_size: int, window: int | None
) -> None:
    """gpt-oss (head 64, window 128) and a Gemma-4-sized head, mixed batch with decodes."""
    spec = BatchSpec((*MIXED, (1, 3000)), num_q_heads=8, num_kv_heads=2, head_size=head_size,
                     block_size=16, dtype=dtype, sliding_window=window)  # fmt: skip
    batch = make_paged_batch(spec, seed=1, device="cuda")
    sinks = torch.linspace(-2.0, 2.0, 8, device="cuda")
    got = run_backend("triton", batch, window, None, sinks)
    want = run_backend("torch", batch, window, None, sinks)
    torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_size", "rotary_dim", "zero_freqs"), [(512, 512, 192), (128, 64, 0)])
def test_triton_keys_from_values_matches_reference(
    dtype: torch.dtype, head_size: int, rotary_dim: int, zero_freqs: int
) -> None:
    """Gemma 4's K = V global layers (head 512, proportional rope) over a mixed batch."""
    spec = BatchSpec((*MIXED, (1, 3000)), num_q_heads=8, num_kv_heads=2, head_size=head_size,
                     block_size=16, dtype=dtype)  # fmt: skip
    batch = make_paged_batch(spec, seed=2, device="cuda")
    derive = make_key_from_value(head_size, rotary_dim, zero_freqs)
    derive = derive._replace(scale=derive.scale.cuda())
    got = run_backend("triton", batch, None, None, None, derive)
    want = run_backend("torch", batch, None, None, None, derive)
    torch.testing.assert_close(got, want, atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_reqs", [1, 4, 64])
def test_triton_decode_with_split_kv_matches_reference(dtype: torch.dtype, num_reqs: int) -> None:
    spec = BatchSpec(((1, 4100),) * num_reqs, num_q_heads=32, num_kv_heads=8, head_size=128,
                     block_size=16, dtype=dtype, sliding_window=1000)  # fmt: skip
    assert_matches_reference("triton", spec, window=1000)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (300, 30.0)])
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_flash_attn_matches_reference(
    dtype: torch.dtype, window: int | None, softcap: float | None, head_size: int
) -> None:
    from kernels import flash_attn

    reason = flash_attn.unsupported_reason(torch.device("cuda"), 256, head_size, dtype)
    if reason is not None:
        if os.environ.get("REQUIRE_FLASH_ATTN") == "1" and flash_attn.import_error():
            pytest.fail(f"the gpu extra is installed, yet flash-attn is unusable: {reason}")
        pytest.skip(reason)
    spec = BatchSpec(MIXED, num_q_heads=32, num_kv_heads=8, head_size=head_size,
                     block_size=256, dtype=dtype, sliding_window=window)  # fmt: skip
    assert_matches_reference("flash_attn", spec, window, softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_store_kv_cache_matches_reference(dtype: torch.dtype) -> None:
    from kernels import triton_store_kv

    spec = BatchSpec((), num_kv_heads=8, head_size=128, block_size=16, dtype=dtype,
                     is_interleaved=True)  # fmt: skip
    caches = allocate_caches(64, spec, device="cuda")
    want = [cache.clone() for cache in caches]
    key, value = torch.randn(2, 300, 8, 128, device="cuda", dtype=dtype).unbind(0)
    slot_mapping = torch.randperm(64 * 16, device="cuda")[:300]
    slot_mapping[::7] = -1
    reference.store_kv_cache(key, value, *want, slot_mapping)
    triton_store_kv.store_kv_cache(key, value, *caches, slot_mapping)
    for got, expected in zip(caches, want, strict=True):
        torch.testing.assert_close(got, expected, equal_nan=True, atol=0, rtol=0)

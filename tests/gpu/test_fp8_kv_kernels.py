"""fp8 KV pages on a GPU: Triton store and attention against the torch reference, and flash-attn
refusing them (so `auto` serves fp8 caches with Triton).

Attention runs bf16 queries over fp8 pages: Triton dequantizes in fp32 and multiplies in bf16,
the reference in fp32, hence the bf16 tolerance. The store must write the reference's bytes.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference, select_backend
from kernels.reference import KeyFromValue
from tests.helpers.fp8_kv_batches import kv_scales, make_fp8_batch
from tests.helpers.kernel_batches import BatchSpec, make_key_from_value

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MIXED = ((1, 300), (77, 77), (40, 530), (0, 20), (1, 1), (129, 200))
SINKS = torch.linspace(-1.0, 2.0, 8)
ATOL = 3e-2


def _triton(block_size: int, head_size: int, kv_dtype: torch.dtype, **needs: bool):  # type: ignore[no-untyped-def]
    return select_backend(
        "triton",
        device="cuda",
        block_size=block_size,
        head_size=head_size,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_dtype,
        **needs,
    )


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize(
    ("window", "softcap", "with_sinks", "derive"),
    [(None, None, False, False), (64, 30.0, True, False), (None, None, False, True)],
)
def test_triton_attention_over_fp8_pages_matches_reference(
    kv_dtype: torch.dtype, window: int | None, softcap: float | None, with_sinks: bool, derive: bool
) -> None:
    spec = BatchSpec(
        MIXED,
        num_q_heads=8,
        num_kv_heads=2,
        head_size=128,
        block_size=16,
        dtype=torch.bfloat16,
        sliding_window=window,
    )
    batch, scales = make_fp8_batch(spec, kv_dtype, device="cuda")
    key_from_value: KeyFromValue | None = None
    if derive:
        batch.key_cache.fill_(float("nan"))
        key_from_value = make_key_from_value(128, 64)
        scales = type(scales)(scales.value, scales.value)
    sinks = SINKS.cuda() if with_sinks else None
    args = (*batch.kernel_args(0.1), window, softcap, sinks, key_from_value)
    want = reference.paged_attention(*args, kv_scales=scales)  # type: ignore[arg-type]
    backend = _triton(16, 128, kv_dtype, has_sinks=with_sinks, keys_from_values=derive)
    got = backend.paged_attention(*args, kv_scales=scales)  # type: ignore[arg-type]
    assert want.isfinite().all()
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_triton_store_writes_the_reference_fp8_bytes(kv_dtype: torch.dtype) -> None:
    pages = torch.full((64, 2, 16, 8, 128), float("nan"), device="cuda").to(kv_dtype)
    want = pages.clone()
    key, value = (torch.randn(2, 500, 8, 128, device="cuda") * 3).to(torch.bfloat16).unbind(0)
    slots = torch.randperm(64 * 16, device="cuda")[:500]
    slots[::7] = -1
    scales = kv_scales("cuda")
    reference.store_kv_cache(key, value, *want.unbind(1), slots, scales)
    _triton(16, 128, kv_dtype).store_kv_cache(key, value, *pages.unbind(1), slots, scales)
    assert torch.equal(pages.view(torch.uint8), want.view(torch.uint8))


def test_auto_serves_fp8_pages_with_triton_and_flash_attn_refuses_them() -> None:
    layout = {"device": "cuda", "block_size": 256, "head_size": 128, "dtype": torch.bfloat16}
    auto = select_backend("auto", **layout, kv_cache_dtype=torch.float8_e4m3fn)
    if torch.cuda.get_device_capability() >= (8, 9):
        assert auto.name == "triton"
    with pytest.raises(ValueError, match="float16/bfloat16 KV pages only"):
        select_backend("flash_attn", **layout, kv_cache_dtype=torch.float8_e4m3fn)

"""The Triton kernels over fp8 KV pages, against the torch reference, under the interpreter.

As in test_triton_interpret.py, each check runs in a fresh Python with TRITON_INTERPRET=1 (set
before triton is imported) and shapes stay tiny. The attention oracle is the reference over
the same fp8 pages (itself equal to the reference over the dequantized pages, test_fp8_kv.py);
the store must write the very bytes the reference writes.
"""

from __future__ import annotations

import pytest

from kernels import HAS_TRITON
from tests.helpers.triton_subprocess import run_interpreted as run_in_interpreter

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


PRELUDE = """
import torch
from kernels import reference, triton_attention, triton_store_kv
from kernels.triton_attention import LaunchConfig
from tests.helpers.fp8_kv_batches import kv_scales, make_fp8_batch
from tests.helpers.kernel_batches import BatchSpec, make_key_from_value

assert triton_attention.is_interpreted()
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MIXED = ((1, 21), (7, 7), (3, 12), (0, 5), (1, 1))
DECODES = ((1, 23), (1, 3))

def check(spec, dtype, launch=None, derive=None, **kwargs):
    batch, scales = make_fp8_batch(spec, dtype)
    if derive is not None:
        batch.key_cache.fill_(float("nan"))  # K = V: keys come from the values
        scales = type(scales)(scales.value, scales.value)
    args = (*batch.kernel_args(0.3), kwargs.get("window"), kwargs.get("softcap"),
            kwargs.get("sinks"), derive)
    want = reference.paged_attention(*args, kv_scales=scales)
    got = triton_attention.paged_attention(*args, kv_scales=scales, launch=launch)
    assert want.isfinite().all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
"""


def run_interpreted(code: str, timeout: float = 180.0) -> None:
    """Run `PRELUDE + code` in the Triton interpreter (`tests.helpers.triton_subprocess`)."""
    run_in_interpreter(PRELUDE, code, timeout=timeout)


def test_attention_over_fp8_pages_matches_reference() -> None:
    """GQA, sliding window + sinks + softcap, K = V (keys rebuilt from fp8 values), split KV."""
    run_interpreted("""
        tile = LaunchConfig(block_q=4, block_n=16, num_splits=1)
        split = LaunchConfig(block_q=2, block_n=16, num_splits=2)
        for dtype in FP8:
            check(BatchSpec(MIXED, num_q_heads=4, num_kv_heads=2, block_size=4), dtype, tile)
            check(BatchSpec(MIXED, num_q_heads=4, num_kv_heads=2, block_size=4,
                            sliding_window=5, is_interleaved=True),
                  dtype, tile, window=5, softcap=2.0, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
            check(BatchSpec(DECODES, num_q_heads=4, num_kv_heads=2, block_size=4), dtype,
                  split, derive=make_key_from_value(16, 12, num_zero_freqs=2))
    """)


def test_store_writes_the_reference_fp8_bytes() -> None:
    run_interpreted("""
        torch.manual_seed(0)  # fixed inputs: a value on a rounding midpoint may round either way
        for dtype in FP8:
            for scales in (kv_scales(), None):
                pages = torch.full((3, 2, 4, 2, 16), float("nan")).to(dtype)  # interleaved K | V
                want = pages.clone()
                key, value = (torch.randn(2, 6, 2, 16) * 2).unbind(0)
                key[0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])  # clamped, not NaN
                slot_mapping = torch.tensor([7, -1, 0, 11, -1, 4])
                reference.store_kv_cache(key, value, *want.unbind(1), slot_mapping, scales)
                triton_store_kv.store_kv_cache(key, value, *pages.unbind(1), slot_mapping, scales)
                assert torch.equal(pages.view(torch.uint8), want.view(torch.uint8))
    """)

"""Triton kernels against the torch reference on CPU, under the Triton interpreter.

Kernels run on CPU only when TRITON_INTERPRET=1 is set before triton is imported, and an
out-of-bounds access there corrupts memory silently; so every check runs in a fresh
subprocess. Shapes are tiny: the interpreter costs about 0.1-0.3 ms per Triton op.
"""

from __future__ import annotations

import pytest

from kernels import HAS_TRITON
from tests.helpers.triton_subprocess import run_interpreted as run_in_interpreter

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


# Defines check(spec, launch=None, window=None, softcap=None, sinks=None, derive=None):
# Triton vs reference.
PRELUDE = """
import torch
from kernels import reference, triton_attention, triton_store_kv
from tests.helpers.kernel_batches import (
    BatchSpec, allocate_caches, make_key_from_value, make_paged_batch)
from kernels.triton_attention import LaunchConfig

assert triton_attention.is_interpreted()
MIXED = ((1, 37), (13, 13), (5, 22), (0, 9), (1, 1), (7, 40), (3, 16))
DECODES = ((1, 45), (1, 3), (1, 64))

def check(spec, launch=None, window=None, softcap=None, atol=1e-5, seed=0, sinks=None,
          derive=None):
    batch = make_paged_batch(spec, seed=seed)
    if derive is not None:
        batch.key_cache.fill_(float("nan"))  # keys come from the values: never read
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_table,
            batch.query_start_loc, batch.seq_lens, 0.3, window, softcap, sinks, derive)
    want = reference.paged_attention(*args)
    got = triton_attention.paged_attention(*args, launch=launch)
    assert got.dtype == batch.query.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
"""


def run_interpreted(code: str, timeout: float = 120.0) -> None:
    """Run `PRELUDE + code` in the Triton interpreter (`tests.helpers.triton_subprocess`)."""
    run_in_interpreter(PRELUDE, code, timeout=timeout)


def test_mixed_batch_with_gqa_matches_reference() -> None:
    run_interpreted("""
        check(BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, block_size=4))
        check(BatchSpec(MIXED, num_q_heads=2, num_kv_heads=2, block_size=16),
              launch=LaunchConfig(block_q=4, block_n=16, num_splits=1))
        check(BatchSpec(MIXED, num_q_heads=8, num_kv_heads=1, block_size=1, is_interleaved=True),
              launch=LaunchConfig(block_q=2, block_n=16, num_splits=1))
    """)


def test_sliding_window_and_softcap_match_reference() -> None:
    run_interpreted("""
        for block_size, window in [(3, 7), (16, 1), (1, 20)]:
            spec = BatchSpec(MIXED, num_q_heads=4, num_kv_heads=2, block_size=block_size,
                             sliding_window=window)
            check(spec, LaunchConfig(block_q=4, block_n=16, num_splits=1), window=window,
                  softcap=2.0)
    """)


def test_split_kv_path_matches_reference() -> None:
    run_interpreted("""
        split = LaunchConfig(block_q=4, block_n=16, num_splits=4)
        check(BatchSpec(DECODES, num_q_heads=8, num_kv_heads=2, block_size=16), split)
        check(BatchSpec(DECODES, num_q_heads=4, num_kv_heads=2, block_size=4, sliding_window=9),
              split, window=9, softcap=2.0)
        check(BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, block_size=4),
              LaunchConfig(block_q=2, block_n=16, num_splits=2))
    """)


def test_head_size_512_with_sinks_and_window_matches_reference() -> None:
    run_interpreted("""
        spec = BatchSpec(((2, 7), (1, 12)), num_q_heads=4, num_kv_heads=1, head_size=512,
                         block_size=4, sliding_window=5)
        check(spec, window=5, sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
        spec = BatchSpec(((1, 9), (1, 3)), num_q_heads=2, num_kv_heads=1, head_size=512)
        check(spec, LaunchConfig(block_q=8, block_n=16, num_splits=2))
    """)


def test_head_sizes_80_96_256_and_half_inputs() -> None:
    run_interpreted("""
        spec = BatchSpec(((2, 11), (1, 6)), num_q_heads=2, num_kv_heads=1, head_size=80)
        check(spec, LaunchConfig(block_q=16, block_n=16, num_splits=1))
        spec = BatchSpec(((3, 9), (1, 5)), num_q_heads=4, num_kv_heads=1, head_size=96,
                         block_size=4, sliding_window=4)
        check(spec, LaunchConfig(block_q=4, block_n=16, num_splits=1), window=4, softcap=2.0)
        spec = BatchSpec(((2, 7), (1, 20)), num_q_heads=2, num_kv_heads=2, head_size=256)
        check(spec, LaunchConfig(block_q=8, block_n=16, num_splits=2))
        for dtype in (torch.float16, torch.bfloat16):
            spec = BatchSpec(((3, 20), (1, 9)), num_q_heads=4, num_kv_heads=2, dtype=dtype)
            check(spec, LaunchConfig(block_q=4, block_n=16, num_splits=2), atol=2e-2)
    """)


def test_store_kv_cache_matches_reference() -> None:
    run_interpreted("""
        for is_interleaved in (False, True):
            spec = BatchSpec((), num_kv_heads=3, head_size=24, block_size=5,
                             is_interleaved=is_interleaved)
            caches = allocate_caches(4, spec)
            want = [cache.clone() for cache in caches]
            key, value = torch.randn(2, 6, 3, 24).unbind(0)
            slot_mapping = torch.tensor([7, -1, 0, 19, -1, 12])
            reference.store_kv_cache(key, value, *want, slot_mapping)
            triton_store_kv.store_kv_cache(key, value, *caches, slot_mapping)
            for got, expected in zip(caches, want):
                torch.testing.assert_close(got, expected, equal_nan=True)
    """)


def test_registry_selects_triton_on_cpu_under_the_interpreter() -> None:
    run_interpreted("""
        from kernels import select_backend
        backend = select_backend("triton", device="cpu", block_size=4, head_size=16)
        assert backend.name == "triton"
        assert select_backend("auto", device="cpu", block_size=4, head_size=16).name == "torch"
    """)


def test_sinks_over_mixed_batches_windows_gqa_and_splits_match_reference() -> None:
    """The reference itself is checked against a dense oracle with sinks (test_reference)."""
    run_interpreted("""
        sinks8 = torch.linspace(-1.5, 2.5, 8)
        check(BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, block_size=4), sinks=sinks8)
        check(BatchSpec(MIXED, num_q_heads=8, num_kv_heads=1, block_size=4, sliding_window=5),
              window=5, sinks=sinks8)
        check(BatchSpec(MIXED, num_q_heads=2, num_kv_heads=2, block_size=16),
              sinks=torch.tensor([4.0, -3.0]),
              launch=LaunchConfig(block_q=4, block_n=16, num_splits=1))
        check(BatchSpec(DECODES, num_q_heads=8, num_kv_heads=2, block_size=4, sliding_window=20),
              window=20, sinks=sinks8, launch=LaunchConfig(block_q=2, block_n=16, num_splits=4))
    """)


def test_keys_from_values_over_mixed_batches_windows_gqa_and_splits_match_reference() -> None:
    """The reference itself is checked against a dense oracle (test_reference)."""
    run_interpreted(
        """
        derive = make_key_from_value(16, 16)
        check(BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, block_size=4), derive=derive)
        check(BatchSpec(MIXED, num_q_heads=4, num_kv_heads=1, block_size=3, sliding_window=5),
              window=5, derive=make_key_from_value(16, 12, num_zero_freqs=2),
              sinks=torch.linspace(-1.0, 1.0, 4))
        check(BatchSpec(DECODES, num_q_heads=8, num_kv_heads=2, block_size=4),
              derive=derive, launch=LaunchConfig(block_q=2, block_n=16, num_splits=4))
        spec = BatchSpec(((2, 7), (1, 12)), num_q_heads=2, num_kv_heads=1, head_size=512,
                         block_size=4)
        check(spec, derive=make_key_from_value(512, 128, num_zero_freqs=16))
        spec = BatchSpec(((3, 20), (1, 9)), num_q_heads=4, num_kv_heads=2, dtype=torch.bfloat16)
        check(spec, LaunchConfig(block_q=4, block_n=16, num_splits=1), atol=2e-2, derive=derive)
    """,
        timeout=300,
    )


def test_causal_loop_split_into_unmasked_and_masked_tiles_matches_reference() -> None:
    """Long chunks over many key tiles: tiles below the diagonal and inside the window go
    unmasked, the window's edge and the diagonal masked; blocks holding whole tiles (one
    block-table lookup per tile) and blocks smaller than a tile, of odd size."""
    run_interpreted("""
        spec = ((40, 72), (24, 24), (1, 70))
        tile = LaunchConfig(block_q=8, block_n=16, num_splits=1)
        check(BatchSpec(spec, num_q_heads=2, num_kv_heads=1, block_size=32), tile)
        check(BatchSpec(spec, num_q_heads=2, num_kv_heads=1, block_size=5, sliding_window=37),
              tile, window=37, sinks=torch.tensor([0.5, -1.0]))
    """)

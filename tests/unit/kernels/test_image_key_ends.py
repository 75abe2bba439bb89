"""Images whose tokens attend to each other both ways (Gemma 3), in every attention kernel.

The kernels get per-row key ends; the oracle masks as transformers composes the rule (causal or
same image, and the sliding window on top). The reference is checked against that oracle, the
batched kernel against the reference, and the Triton kernel (and flash-attn, which hands such
calls to Triton) against the reference under the Triton interpreter in a fresh process.
"""

from __future__ import annotations

import pytest
import torch

from kernels import HAS_TRITON, batched_attention, reference
from tests.helpers.image_spans import dense_image_attention, key_ends_of
from tests.helpers.kernel_batches import BatchSpec, make_paged_batch
from tests.unit.kernels.test_triton_interpret import run_interpreted

SCALE = 0.3
# decode, fresh prefill with two images, chunk with an image, empty query, one-token request,
# chunk whose image is longer than the windows below, chunk ending with its image, decodes
MIXED = ((1, 37), (13, 13), (5, 22), (0, 9), (1, 1), (7, 40), (3, 16), (1, 5))
IMAGES = {1: [(2, 6), (8, 12)], 2: [(17, 21)], 5: [(34, 39)], 6: [(13, 16)]}
WINDOWS = (None, 3, 6)


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_masks_images_as_transformers_does(window: int | None) -> None:
    batch = make_paged_batch(
        BatchSpec(MIXED, num_q_heads=4, num_kv_heads=2, block_size=4, sliding_window=window)
    )
    key_ends = key_ends_of(batch, IMAGES)
    got = reference.paged_attention(*batch.kernel_args(SCALE), window, key_ends=key_ends)
    want = dense_image_attention(batch, SCALE, IMAGES, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    causal = reference.paged_attention(*batch.kernel_args(SCALE), window)
    assert not torch.allclose(causal, got), "the images change the outputs"


@pytest.mark.parametrize("window", WINDOWS)
def test_batched_kernel_matches_the_reference_with_images(window: int | None) -> None:
    batch = make_paged_batch(
        BatchSpec(MIXED, num_q_heads=6, num_kv_heads=2, block_size=3, sliding_window=window)
    )
    key_ends = key_ends_of(batch, IMAGES)
    args = batch.kernel_args(SCALE)
    got = batched_attention.paged_attention(*args, window, key_ends=key_ends)
    want = reference.paged_attention(*args, window, key_ends=key_ends)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_and_flash_attn_match_the_reference_with_images() -> None:
    run_interpreted(f"""
        from kernels import flash_attn
        from tests.helpers.image_spans import key_ends_of
        MIXED, IMAGES = {MIXED!r}, {IMAGES!r}
        launches = (None, LaunchConfig(block_q=2, block_n=4, num_splits=1),
                    LaunchConfig(block_q=4, block_n=8, num_splits=2))
        for window, launch in zip((None, 3, 6), launches):
            spec = BatchSpec(MIXED, num_q_heads=4, num_kv_heads=2, block_size=4,
                             sliding_window=window)
            batch = make_paged_batch(spec)
            key_ends = key_ends_of(batch, IMAGES)
            args = (*batch.kernel_args(0.3), window)
            want = reference.paged_attention(*args, key_ends=key_ends)
            got = triton_attention.paged_attention(*args, key_ends=key_ends, launch=launch)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            handed = flash_attn.paged_attention(*args, key_ends=key_ends)
            torch.testing.assert_close(handed, want, atol=1e-5, rtol=1e-5)
    """)

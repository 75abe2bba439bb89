"""The torch reference kernels against a naive dense attention over unpaged K/V."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference
from tests.helpers.kernel_batches import (
    BatchSpec,
    PagedBatch,
    allocate_caches,
    dense_attention,
    make_key_from_value,
    make_paged_batch,
)

# decode, fresh prefill, chunked prefill after a prefix, empty query, one-token request,
# lengths ending mid-block and on a block boundary
MIXED = ((1, 37), (13, 13), (5, 22), (0, 9), (1, 1), (7, 40), (3, 16))
GQA = {1: (2, 2), 4: (8, 2), 8: (8, 1)}  # ratio -> (num_q_heads, num_kv_heads)
SCALE = 0.3


def run_reference(batch: PagedBatch, **kwargs: float | int | None) -> torch.Tensor:
    return reference.paged_attention(*batch.kernel_args(SCALE), **kwargs)  # type: ignore[arg-type]


def assert_matches_dense(
    batch: PagedBatch, window: int | None = None, softcap: float | None = None, atol: float = 1e-5
) -> None:
    got = run_reference(batch, sliding_window=window, softcap=softcap)
    want = dense_attention(batch, SCALE, window, softcap)
    assert got.dtype == batch.query.dtype
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    ("block_size", "window", "ratio"),
    list(itertools.product([1, 4, 16], [None, 1, 7], [1, 4, 8])),
)
def test_mixed_batch_matches_dense(block_size: int, window: int | None, ratio: int) -> None:
    num_q_heads, num_kv_heads = GQA[ratio]
    spec = BatchSpec(
        MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        sliding_window=window,
        is_interleaved=ratio == 4,
    )
    batch = make_paged_batch(spec, seed=block_size + ratio)
    assert_matches_dense(batch, window, softcap=None if ratio == 1 else 2.0)


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 128, 256, 512])
def test_every_supported_head_size_matches_dense(head_size: int) -> None:
    spec = BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, head_size=head_size, block_size=16)
    batch = make_paged_batch(spec, seed=head_size)
    atol = 1e-5 if head_size <= 256 else 5e-5  # fp32 dot products over 512 features
    assert_matches_dense(batch, atol=atol)
    windowed = make_paged_batch(replace(spec, sliding_window=9), seed=head_size)
    assert_matches_dense(windowed, window=9, softcap=4.0, atol=atol)


@pytest.mark.parametrize("stale_block_id", [-1, 0, 10**6])
def test_never_reads_block_table_entries_outside_the_window(stale_block_id: int) -> None:
    spec = BatchSpec(MIXED, block_size=4, sliding_window=6, stale_block_id=stale_block_id)
    assert_matches_dense(make_paged_batch(spec), window=6)


def test_long_prefill_is_split_into_query_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reference, "_MAX_SCORE_ELEMENTS", 4 * 40)
    batch = make_paged_batch(BatchSpec(((30, 40), (1, 9)), block_size=4, sliding_window=9))
    assert_matches_dense(batch, window=9, softcap=3.0)


def test_batch_of_empty_queries_returns_empty_output() -> None:
    batch = make_paged_batch(BatchSpec(((0, 5), (0, 3))))
    assert run_reference(batch).shape == (0, 4, 16)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_precision_inputs_within_tolerance(dtype: torch.dtype, atol: float) -> None:
    spec = BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, block_size=4, dtype=dtype)
    assert_matches_dense(make_paged_batch(spec, seed=3), window=None, softcap=5.0, atol=atol)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 30)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 2, 3, 8]),
    window=st.one_of(st.none(), st.integers(1, 20)),
    seed=st.integers(0, 1000),
)
def test_random_batches_match_dense(
    lengths: list[tuple[int, int]], block_size: int, window: int | None, seed: int
) -> None:
    requests = tuple((min(q_len, seq_len), seq_len) for q_len, seq_len in lengths)
    spec = BatchSpec(requests, block_size=block_size, sliding_window=window)
    assert_matches_dense(make_paged_batch(spec, seed=seed), window)


@pytest.mark.parametrize("is_interleaved", [False, True])
def test_store_kv_cache_skips_padding_and_writes_through_views(is_interleaved: bool) -> None:
    spec = BatchSpec((), num_kv_heads=2, head_size=8, block_size=4, is_interleaved=is_interleaved)
    key_cache, value_cache = allocate_caches(6, spec)
    key, value = torch.randn(2, 5, 2, 8).unbind(0)
    slot_mapping = torch.tensor([9, -1, 0, 23, -1])
    reference.store_kv_cache(key, value, key_cache, value_cache, slot_mapping)

    flat_keys, flat_values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    for token, slot in [(0, 9), (2, 0), (3, 23)]:
        torch.testing.assert_close(flat_keys[slot], key[token])
        torch.testing.assert_close(flat_values[slot], value[token])
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[[9, 0, 23]] = False
    assert flat_keys[untouched].isnan().all()
    assert flat_values[untouched].isnan().all()


@pytest.mark.parametrize(("window", "ratio"), list(itertools.product([None, 1, 7], [1, 4, 8])))
def test_sinks_over_a_mixed_batch_match_dense(window: int | None, ratio: int) -> None:
    """Sink logits join each query head's softmax denominator, for decodes and prefills."""
    num_q_heads, num_kv_heads = GQA[ratio]
    spec = BatchSpec(
        MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=4,
        sliding_window=window,
    )
    batch = make_paged_batch(spec, seed=ratio)
    sinks = torch.linspace(-2.0, 3.0, num_q_heads)
    got = run_reference(batch, sliding_window=window, sinks=sinks)  # type: ignore[arg-type]
    want = dense_attention(batch, SCALE, window, sinks=sinks)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    without = dense_attention(batch, SCALE, window)
    assert not torch.allclose(want[batch.query_start_loc[1] :], without[batch.query_start_loc[1] :])


@pytest.mark.parametrize(
    ("window", "ratio", "rotary_dim", "zero_freqs"),
    [(None, 1, 16, 0), (7, 4, 16, 3), (None, 8, 10, 0), (1, 4, 12, 2)],
)
def test_keys_from_values_over_a_mixed_batch_match_dense(
    window: int | None, ratio: int, rotary_dim: int, zero_freqs: int
) -> None:
    """Keys rebuilt as rope(value * scale) at each cached position; the key cache (NaN) is
    never read."""
    num_q_heads, num_kv_heads = GQA[ratio]
    spec = BatchSpec(
        MIXED, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, sliding_window=window
    )
    batch = make_paged_batch(spec, seed=ratio)
    batch.key_cache.fill_(float("nan"))
    derive = make_key_from_value(spec.head_size, rotary_dim, zero_freqs)
    got = run_reference(batch, sliding_window=window, key_from_value=derive)  # type: ignore[arg-type]
    want = dense_attention(batch, SCALE, window, key_from_value=derive)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    if window != 1:  # a one-token window attends to itself whatever the keys
        still = derive._replace(inv_freq=torch.zeros_like(derive.inv_freq))
        assert not torch.allclose(want, dense_attention(batch, SCALE, window, key_from_value=still))

"""The batched torch kernels against the per-request reference (their exactness oracle).

The batches come from `make_paged_batch`: unused cache slots and stale block-table entries hold
NaN, so reading anything outside a request's visible keys shows up in the output.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import batched_attention, reference
from tests.helpers.kernel_batches import (
    BatchSpec,
    PagedBatch,
    make_key_from_value,
    make_paged_batch,
)

# decode, fresh prefill, chunked prefill, empty query, one-token request, several decodes of
# different lengths (ending mid-block and on a block boundary)
MIXED = ((1, 37), (13, 13), (5, 22), (0, 9), (1, 1), (7, 40), (1, 16), (1, 5), (3, 16))
DECODES = tuple((1, seq_len) for seq_len in (1, 2, 7, 16, 17, 33, 64, 3))
GQA = {1: (2, 2), 3: (6, 2), 8: (8, 1)}  # ratio -> (num_q_heads, num_kv_heads)
SCALE = 0.3


def run_both(batch: PagedBatch, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    args = batch.kernel_args(SCALE)
    got = batched_attention.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    want = reference.paged_attention(*args, **kwargs)  # type: ignore[arg-type]
    return got, want


def assert_same(batch: PagedBatch, atol: float = 1e-5, **kwargs: object) -> None:
    got, want = run_both(batch, **kwargs)
    assert got.dtype == want.dtype
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize(
    ("requests", "window", "ratio", "interleaved"),
    [
        *itertools.product([MIXED, DECODES], [None, 1, 6], [1, 3, 8], [False]),
        (MIXED, None, 3, True),
        (DECODES, 6, 8, True),
    ],
)
def test_matches_reference(
    requests: tuple[tuple[int, int], ...], window: int | None, ratio: int, interleaved: bool
) -> None:
    num_q_heads, num_kv_heads = GQA[ratio]
    spec = BatchSpec(
        requests,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        block_size=4,
        sliding_window=window,
        is_interleaved=interleaved,
    )
    assert_same(make_paged_batch(spec, seed=ratio), sliding_window=window)


@pytest.mark.parametrize("stale_block_id", [-1, 0, 10**6])
def test_never_reads_block_table_entries_outside_the_window(stale_block_id: int) -> None:
    spec = BatchSpec(DECODES, block_size=4, sliding_window=6, stale_block_id=stale_block_id)
    assert_same(make_paged_batch(spec), sliding_window=6)


@pytest.mark.parametrize("window", [None, 5])
def test_softcap_and_sinks_match_reference(window: int | None) -> None:
    spec = BatchSpec(MIXED, num_q_heads=6, num_kv_heads=2, block_size=4, sliding_window=window)
    batch = make_paged_batch(spec, seed=3)
    assert_same(batch, sliding_window=window, softcap=2.5)
    assert_same(batch, sliding_window=window, sinks=torch.linspace(-2.0, 3.0, 6))


@pytest.mark.parametrize("window", [None, 7])
def test_keys_from_values_match_reference(window: int | None) -> None:
    spec = BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, sliding_window=window)
    batch = make_paged_batch(spec, seed=1)
    batch.key_cache.fill_(float("nan"))
    derive = make_key_from_value(spec.head_size, 12, 2)
    assert_same(batch, sliding_window=window, key_from_value=derive)


def test_decodes_past_the_gather_budget_go_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    chunks: list[int] = []
    decode = batched_attention._decode

    def counting_decode(query: torch.Tensor, *args: object) -> torch.Tensor:
        chunks.append(query.shape[0])
        return decode(query, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(batched_attention, "_MAX_GATHER_ELEMENTS", 64 * 2 * 16 * 2)
    monkeypatch.setattr(batched_attention, "_decode", counting_decode)
    assert_same(make_paged_batch(BatchSpec(DECODES, block_size=4)))
    assert len(chunks) > 1
    assert sum(chunks) == len(DECODES)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 1.6e-2)])
def test_half_precision_within_tolerance(dtype: torch.dtype, atol: float) -> None:
    spec = BatchSpec(MIXED, num_q_heads=8, num_kv_heads=2, block_size=4, dtype=dtype)
    assert_same(make_paged_batch(spec), atol=atol)


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(
        st.integers(1, 30).flatmap(
            lambda seq_len: st.tuples(st.sampled_from([1, 1, 1, seq_len]), st.just(seq_len))
        ),
        min_size=1,
        max_size=8,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.sampled_from([None, 1, 3, 9]),
)
def test_random_batches_match_reference(
    requests: list[tuple[int, int]], block_size: int, window: int | None
) -> None:
    spec = BatchSpec(tuple(requests), block_size=block_size, sliding_window=window)
    assert_same(make_paged_batch(spec), sliding_window=window)

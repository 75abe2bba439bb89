"""Metadata transforms: chunked-local virtual batches (S26), truncated prefill (S27), and both.

Numerical checks run the torch reference paged-attention kernel on the transformed metadata
and compare with dense attention under the chunked-local causal mask.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import HAS_TRITON
from kernels.reference import paged_attention, store_kv_cache
from worker.attention.attention import AttentionMetadata
from worker.attention.metadata_transforms import (
    ChunkedLocalBatches,
    StepRows,
    TruncatedPrefill,
    apply_transforms,
    make_virtual_batches,
    truncate_prefill,
)


def _arange_table(num_reqs: int, max_seq_len: int, block_size: int) -> torch.Tensor:
    cols = -(-max_seq_len // block_size)
    return torch.arange(num_reqs * cols, dtype=torch.int32).view(num_reqs, cols)


def _qsl(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


# S26: (C, bs, query lens, seq lens, virtual q, virtual k, virtual block table)
S26 = [
    (
        4,
        2,
        [4, 10, 5],
        [6, 17, 9],
        [2, 2, 1, 4, 4, 1, 4, 1],
        [4, 2, 4, 4, 4, 1, 4, 1],
        [[0, 1], [2, 3], [11, 12], [13, 14], [15, 16], [17, 17], [20, 21], [22, 23]],
    ),
    (4, 2, [8], [12], [4, 4], [4, 4], [[2, 3], [4, 5]]),
    (4, 2, [7], [10], [1, 4, 2], [4, 4, 2], [[0, 1], [2, 3], [4, 4]]),
    (10, 2, [4], [6], [4], [6], [[0, 1, 2, 2, 2]]),
    (4, 4, [6, 6], [8, 8], [2, 4, 2, 4], [4, 4, 4, 4], [[0], [1], [2], [3]]),
    (4, 2, [1], [5], [1], [1], [[2, 2]]),
]


@pytest.mark.parametrize(("chunk", "bs", "q_lens", "k_lens", "vq", "vk", "vtable"), S26)
def test_virtual_batches_match_s26(chunk, bs, q_lens, k_lens, vq, vk, vtable):
    table = _arange_table(len(q_lens), max(k_lens), bs)
    out = make_virtual_batches(_qsl(q_lens), torch.tensor(k_lens), table, chunk, bs)
    assert torch.diff(out.query_start_loc).tolist() == vq
    assert out.seq_lens.tolist() == vk
    assert out.block_table.tolist() == vtable
    assert out.max_query_len == max(vq)
    assert out.max_seq_len == max(vk)
    assert max(vq) <= chunk
    assert max(vk) <= chunk
    assert int(out.query_start_loc[-1]) == sum(q_lens)


def test_virtual_batches_s26_case1_offsets():
    table = _arange_table(3, 17, 2)
    out = make_virtual_batches(_qsl([4, 10, 5]), torch.tensor([6, 17, 9]), table, 4, 2)
    assert out.query_start_loc.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    assert out.key_starts.tolist() == [0, 4, 4, 8, 12, 16, 4, 8]
    computed = out.seq_lens - torch.diff(out.query_start_loc)
    assert computed.tolist() == [2, 0, 3, 0, 0, 0, 0, 0]
    assert out.req_indices.tolist() == [0, 0, 1, 1, 1, 1, 2, 2]


def test_chunk_not_multiple_of_block_is_rejected_when_the_transform_is_built():
    with pytest.raises(ValueError, match="chunk size 6 is not a multiple of the KV cache block"):
        make_virtual_batches(_qsl([1]), torch.tensor([5]), _arange_table(1, 5, 4), 6, 4)
    with pytest.raises(ValueError, match="choose a block_size that divides 8"):
        ChunkedLocalBatches(8, 16)


def _brute_force_virtual(q_len, k_len, chunk):
    """Group the request's query positions by chunk: (q, k, key start, table row) per group."""
    positions = list(range(k_len - q_len, k_len))
    if not positions:  # no query rows: one empty virtual request over the last chunk
        start = (k_len - 1) // chunk * chunk
        return [(0, k_len - start, start)]
    spans = []
    for chunk_idx in sorted({pos // chunk for pos in positions}):
        rows = [pos for pos in positions if pos // chunk == chunk_idx]
        spans.append((len(rows), rows[-1] - chunk_idx * chunk + 1, chunk_idx * chunk))
    return spans


@pytest.mark.parametrize(("chunk", "bs"), [(4, 2), (4, 4), (8, 2), (6, 3)])
def test_virtual_batches_match_a_brute_force_split_at_and_around_chunk_boundaries(chunk, bs):
    """Every single request with k <= 3 chunks + 1 and 0 <= q <= k, then all of them at once."""
    cases = [(q, k) for k in range(1, 3 * chunk + 2) for q in range(k + 1)]
    table = _arange_table(len(cases), 3 * chunk + 1, bs)
    expected = []
    for req, (q, k) in enumerate(cases):
        for vq, vk, start in _brute_force_virtual(q, k, chunk):
            cols = [min(start // bs + j, table.shape[1] - 1) for j in range(chunk // bs)]
            expected.append((req, vq, vk, start, table[req, cols].tolist()))
    out = make_virtual_batches(
        _qsl([q for q, _ in cases]), torch.tensor([k for _, k in cases]), table, chunk, bs
    )
    got = list(
        zip(
            out.req_indices.tolist(),
            torch.diff(out.query_start_loc).tolist(),
            out.seq_lens.tolist(),
            out.key_starts.tolist(),
            out.block_table.tolist(),
            strict=True,
        )
    )
    assert got == [tuple(row) for row in expected]


# S27: (query_start_loc, logits indices, new query_start_loc or None for pass-through, max_q, n)
S27 = [
    ([0, 15, 20, 28], [14, 18, 19, 27], [0, 1, 3, 4], 2, 4),
    ([0, 5, 6, 16], [4, 5, 15], [0, 1, 2, 3], 1, 3),
    ([0, 1, 2, 3], [0, 1, 2], None, 1, 3),
    ([0, 6, 9], [5, 6, 7, 8], [0, 1, 4], 3, 4),
]


@pytest.mark.parametrize(("qsl", "logits", "new_qsl", "max_q", "num_tokens"), S27)
def test_truncated_prefill_matches_s27(qsl, logits, new_qsl, max_q, num_tokens):
    out = truncate_prefill(torch.tensor(qsl, dtype=torch.int32), torch.tensor(logits))
    assert out.max_query_len == max_q
    assert out.num_actual_tokens == num_tokens
    if new_qsl is None:
        assert out.query_rows is None
        assert out.query_start_loc.tolist() == qsl
    else:
        assert out.query_start_loc.tolist() == new_qsl
        assert out.query_rows.tolist() == logits


def test_truncated_prefill_keeps_every_row_of_prompt_logprob_requests():
    qsl = torch.tensor([0, 15, 20, 28], dtype=torch.int32)
    out = truncate_prefill(qsl, torch.tensor([14, 18, 19, 27]), full_reqs=torch.tensor([0]))
    assert out.query_start_loc.tolist() == [0, 15, 17, 18]
    assert out.query_rows.tolist() == [*range(15), 18, 19, 27]
    assert out.max_query_len == 15


def test_truncated_prefill_rejects_rows_that_are_not_a_suffix():
    with pytest.raises(AssertionError, match="suffix"):
        truncate_prefill(torch.tensor([0, 5, 9], dtype=torch.int32), torch.tensor([3, 8]))


# ---- numerics: reference kernel on transformed metadata vs dense chunked attention ----

HEADS, KV_HEADS, HEAD = 4, 2, 8


def _paged_batch(q_lens, k_lens, block_size, seed=0):
    """Random K/V of every request scattered into shuffled blocks; queries for the new rows."""
    gen = torch.Generator().manual_seed(seed)
    cols = -(-max(k_lens) // block_size)
    num_blocks = len(k_lens) * cols + 1
    table = torch.randperm(num_blocks - 1, generator=gen)[: len(k_lens) * cols] + 1
    table = table.view(len(k_lens), cols).to(torch.int32)
    shape = (num_blocks, block_size, KV_HEADS, HEAD)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    keys = [torch.randn(k, KV_HEADS, HEAD, generator=gen) for k in k_lens]
    values = [torch.randn(k, KV_HEADS, HEAD, generator=gen) for k in k_lens]
    for req, k in enumerate(k_lens):
        pos = torch.arange(k)
        slots = table[req, pos // block_size].long() * block_size + pos % block_size
        store_kv_cache(keys[req], values[req], key_cache, value_cache, slots)
    query = torch.randn(sum(q_lens), HEADS, HEAD, generator=gen)
    meta = AttentionMetadata(
        query_start_loc=_qsl(q_lens),
        seq_lens=torch.tensor(k_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64),
        max_query_len=max(q_lens),
        max_seq_len=max(k_lens),
        num_actual_tokens=sum(q_lens),
        store_kv_cache=store_kv_cache,
        paged_attention=paged_attention,
    )
    return meta, query, (key_cache, value_cache), keys, values


def _dense_chunked(query, q_lens, keys, values, chunk):
    """Per-row dense attention where a query at p sees keys in [p // C * C, p]."""
    out, row = [], 0
    for q_len, key, value in zip(q_lens, keys, values, strict=True):
        k_len = key.shape[0]
        for pos in range(k_len - q_len, k_len):
            lo = pos // chunk * chunk if chunk else 0
            kk = key[lo : pos + 1].repeat_interleave(HEADS // KV_HEADS, dim=1)
            vv = value[lo : pos + 1].repeat_interleave(HEADS // KV_HEADS, dim=1)
            scores = torch.einsum("hd,khd->hk", query[row], kk) / HEAD**0.5
            out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), vv))
            row += 1
    return torch.stack(out)


def _run(meta, query, caches):
    return meta.paged_attention(
        query, *caches, meta.block_table, meta.query_start_loc, meta.seq_lens, HEAD**-0.5
    )


@pytest.mark.parametrize(
    ("chunk", "bs", "q_lens", "k_lens"),
    [
        (4, 2, [4, 10, 5], [6, 17, 9]),
        (8, 4, [13, 1, 20], [13, 30, 41]),
        (4, 4, [1, 1], [4, 5]),
    ],
)
def test_virtual_batches_attention_equals_dense_chunked_attention(chunk, bs, q_lens, k_lens):
    meta, query, caches, keys, values = _paged_batch(q_lens, k_lens, bs)
    step = StepRows(logits_indices=meta.query_start_loc[1:].long() - 1)
    virtual = apply_transforms(meta, (ChunkedLocalBatches(chunk, bs),), step)
    expected = _dense_chunked(query, q_lens, keys, values, chunk)
    torch.testing.assert_close(_run(virtual, query, caches), expected, atol=1e-5, rtol=1e-5)


def test_truncate_then_virtual_batches_composition():
    """Hand derivation (C = 4, kernel bs = 2, two requests).

    Request 0: q = 6, k = 6 (fresh prompt, asked for prompt logprobs -> all 6 rows kept).
    Request 1: q = 3, k = 9 (rows 6..8; only its last row 8 reaches the LM head).
    Truncation keeps rows [0..5, 8]: query_start_loc [0, 6, 7], seq_lens stay [6, 9].
    Virtual batches on that:
      req 0: context 0, q_first = min(4 - 0, 6) = 4, last = (6 - 1) % 4 + 1 = 2,
             nv = 1 + ceil(2 / 4) = 2 -> q [4, 2], k [4, 2], key starts [0, 4],
             table columns [0, 1] and [2, 3] of row 0.
      req 1: context 8, q_first = min(4 - 0, 1) = 1, last = (9 - 1) % 4 + 1 = 1, nv = 1
             -> q [1], k [1], key start 8, columns [4, 5] clipped to the last column 4.
    Result: query_start_loc [0, 4, 6, 7], seq_lens [4, 2, 1], 7 rows [0..5, 8].
    """
    meta, query, caches, keys, values = _paged_batch([6, 3], [6, 9], 2)
    step = StepRows(logits_indices=torch.tensor([5, 8]), full_reqs=torch.tensor([0]))
    out = apply_transforms(meta, (TruncatedPrefill(), ChunkedLocalBatches(4, 2)), step)
    table = meta.block_table
    assert out.query_start_loc.tolist() == [0, 4, 6, 7]
    assert out.seq_lens.tolist() == [4, 2, 1]
    assert out.query_rows.tolist() == [0, 1, 2, 3, 4, 5, 8]
    assert out.block_table.tolist() == [
        table[0, :2].tolist(),
        table[0, 2:4].tolist(),
        [int(table[1, 4])] * 2,
    ]
    assert (out.max_query_len, out.max_seq_len, out.num_actual_tokens) == (4, 4, 7)
    assert torch.equal(out.slot_mapping, meta.slot_mapping)
    dense = _dense_chunked(query, [6, 3], keys, values, 4)
    got = _run(out, query[out.query_rows], caches)
    torch.testing.assert_close(got, dense[out.query_rows], atol=1e-5, rtol=1e-5)


def test_truncated_prefill_transform_passes_pure_decode_through():
    meta, _, _, _, _ = _paged_batch([1, 1, 1], [9, 9, 9], 4)
    step = StepRows(logits_indices=torch.tensor([0, 1, 2]))
    assert apply_transforms(meta, (TruncatedPrefill(),), step) is meta


# A mixed step (C = 4, kernel bs = 2): A is a prompt chunk that samples nothing (q 6, k 6), B
# decodes (q 1, k 9), C finishes its prompt (q 5, k 13), D is a prompt chunk of a request asking
# for prompt logprobs (q 4, k 8). Rows: A 0-5, B 6, C 7-11, D 12-15; sampled rows 6 and 11.
MIXED_Q, MIXED_K = [6, 1, 5, 4], [6, 9, 13, 8]
MIXED_STEP = StepRows(logits_indices=torch.tensor([6, 11]), full_reqs=torch.tensor([3]))


def test_truncated_prefill_of_a_mixed_step_drops_chunks_that_sample_nothing():
    meta, query, caches, keys, values = _paged_batch(MIXED_Q, MIXED_K, 2)
    out = apply_transforms(meta, (TruncatedPrefill(),), MIXED_STEP)
    assert out.query_rows.tolist() == [6, 11, 12, 13, 14, 15]
    assert out.query_start_loc.tolist() == [0, 0, 1, 2, 6]
    assert (out.max_query_len, out.num_actual_tokens) == (4, 6)
    assert out.seq_lens is meta.seq_lens
    assert out.block_table is meta.block_table
    assert out.slot_mapping is meta.slot_mapping
    dense = _dense_chunked(query, MIXED_Q, keys, values, chunk=0)
    got = _run(out, query[out.query_rows], caches)
    torch.testing.assert_close(got, dense[out.query_rows], atol=1e-5, rtol=1e-5)


def test_truncate_then_virtual_batches_on_a_mixed_step():
    """A keeps one empty virtual request over its last chunk (keys 4..5); B's row 8, C's row 12
    and D's rows 4..7 each sit in one chunk: virtual q [0, 1, 1, 4], k [2, 1, 1, 4]."""
    meta, query, caches, keys, values = _paged_batch(MIXED_Q, MIXED_K, 2)
    out = apply_transforms(meta, (TruncatedPrefill(), ChunkedLocalBatches(4, 2)), MIXED_STEP)
    assert out.query_start_loc.tolist() == [0, 0, 1, 2, 6]
    assert out.seq_lens.tolist() == [2, 1, 1, 4]
    table = meta.block_table.tolist()
    last = table[2][6]  # C's columns 6..7: 7 is past its table (7 columns) and clipped to 6
    assert out.block_table.tolist() == [table[0][2:4], table[1][4:6], [last, last], table[3][2:4]]
    dense = _dense_chunked(query, MIXED_Q, keys, values, chunk=4)
    got = _run(out, query[out.query_rows], caches)
    torch.testing.assert_close(got, dense[out.query_rows], atol=1e-5, rtol=1e-5)


TRITON_CHECK = """
import torch
from kernels import triton_attention
from tests.unit.worker import test_metadata_transforms as t
from worker.attention.metadata_transforms import (
    ChunkedLocalBatches, TruncatedPrefill, apply_transforms,
)

assert triton_attention.is_interpreted()
meta, query, caches, keys, values = t._paged_batch(t.MIXED_Q, t.MIXED_K, 2)
for chunk in (0, 4):
    transforms = (TruncatedPrefill(),) + ((ChunkedLocalBatches(chunk, 2),) if chunk else ())
    out = apply_transforms(meta, transforms, t.MIXED_STEP)
    got = triton_attention.paged_attention(
        query[out.query_rows], *caches, out.block_table, out.query_start_loc, out.seq_lens,
        t.HEAD**-0.5,
    )
    dense = t._dense_chunked(query, t.MIXED_Q, keys, values, chunk)
    torch.testing.assert_close(got, dense[out.query_rows], atol=1e-5, rtol=1e-5)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_transformed_metadata_runs_on_the_triton_kernel():
    """The same mixed step through the Triton kernel (CPU interpreter, fresh process)."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

"""Triton paged attention over a mixed batch of prefill chunks and decodes, in one launch.

A program owns one query tile (`BLOCK_Q` tokens of one request x all query heads of one KV
head, so GQA decode runs on tensor cores), one KV head and one split of the key range:

    grid = (query tiles, num_kv_heads, num_splits)
    query tile rows:  row r -> token r // GROUP_PAD, query head kv_head * GROUP + r % GROUP_PAD

With more than one split (long decodes, few requests) each split writes an unnormalised
partial result and a second kernel merges them. Keys are walked in tiles of `BLOCK_N`
positions, first the tiles every row of the query tile sees whole, without masks, then the
masked ones (the window's edge and the diagonal):

    keys:  | window edge | unmasked tiles ... | diagonal |      (per query tile and split)
             masked        no mask               masked

Block size is free (a compile-time constant): a tile inside one block takes one block-table
lookup, a tile over several blocks one per position. fp8 pages are dequantized as they are
loaded (`fp8 * scale` in fp32, `kernels.kv_quant`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.kv_quant import KVScales, is_fp8, scale_tensors
from kernels.reference import (
    KeyFromValue,
    check_attention_args,
    check_key_ends,
    check_key_from_value,
)

_LOG2E = tl.constexpr(1.4426950408889634)


class LaunchConfig(NamedTuple):
    """Tile sizes and KV splits of one launch (`choose_launch_config` picks defaults)."""

    block_q: int
    """Query tokens per tile; the tile has `block_q * next_pow2(group)` rows (>= 16)."""
    block_n: int
    """Key positions per inner-loop step."""
    num_splits: int
    """Splits of each key range (a power of two); > 1 adds a merge kernel."""
    num_warps: int = 4
    num_stages: int = 3
    """Software-pipelining stages of the key loop (Triton's default on CUDA)."""


def is_interpreted() -> bool:
    """Whether Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


@triton.jit  # type: ignore[untyped-decorator]
def _find_request(query_start_loc_ptr, num_reqs, tile_idx, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]
    # Request i's tiles start at query_start_loc[i] // BLOCK_Q + i, which bounds the tiles of
    # the requests before it; return the last request whose first tile is <= tile_idx.
    lo = tl.zeros((), tl.int32)
    hi = num_reqs + tl.zeros((), tl.int32)
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        is_before = first_tile <= tile_idx
        lo = tl.where(is_before, mid + 1, lo)
        hi = tl.where(is_before, hi, mid)
    return lo - 1


@triton.jit
def _tanh(x):  # type: ignore[no-untyped-def]
    # No libdevice (the interpreter lacks it): tanh(x) = 1 - 2 / (exp(2x) + 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit  # type: ignore[untyped-decorator]
def _rotate_values_into_keys(  # type: ignore[no-untyped-def]
    v, v_cache_ptr, v_offs, k_mask, key_pos, dims, dim_ok, key_scale_ptr, inv_freq_ptr,
    rope_scaling, value_scale, ROTARY_DIM: tl.constexpr,
):  # fmt: skip
    # Key tile [HEAD_PAD, BLOCK_N] = rope(value * scale) (see kernels.reference.KeyFromValue):
    # rotated features pair d with d +- ROTARY_DIM / 2 (rotate-half), the others pass. `v` is
    # already dequantized; the partner features read here are scaled by `value_scale` (fp8).
    HALF: tl.constexpr = ROTARY_DIM // 2
    is_rotated = dims < ROTARY_DIM
    partner = tl.where(dims < HALF, dims + HALF, dims - HALF)
    partner = tl.where(is_rotated, partner, dims)
    key_scale = tl.load(key_scale_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
    partner_scale = tl.load(key_scale_ptr + partner, mask=dim_ok, other=0.0).to(tl.float32)
    own = tl.trans(v)  # the value tile [BLOCK_N, HEAD_PAD], as a key tile
    paired = tl.load(v_cache_ptr + v_offs[None, :] + partner[:, None], mask=k_mask, other=0.0)
    own = own.to(tl.float32) * key_scale[:, None]
    paired = paired.to(tl.float32) * (partner_scale[:, None] * value_scale)
    freq = tl.load(inv_freq_ptr + dims % HALF, mask=is_rotated, other=0.0)
    angle = key_pos[None, :].to(tl.float32) * freq[:, None]
    sign = tl.where(dims < HALF, -1.0, 1.0)
    rotated = (
        own * tl.cos(angle) * rope_scaling + sign[:, None] * paired * tl.sin(angle) * rope_scaling
    )
    return tl.where(is_rotated[:, None], rotated, own)


@triton.jit  # type: ignore[untyped-decorator]
def _tile_blocks(block_table_row, key_tile, key_ok, BLOCK_N: tl.constexpr,  # type: ignore[no-untyped-def]
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    # (block id, slot in block) of the tile's key positions, from one block-table lookup when
    # the tile lies inside one block, else one per block the tile touches (per position,
    # masked on the tile's edges). BLOCK_SIZE is a constexpr: `//` and `%` are shifts or
    # multiplies, never divisions.
    first = key_tile * BLOCK_N
    key_pos = first + tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:
        block_ids = tl.load(block_table_row + first // BLOCK_SIZE)  # a scalar
        slot_in_block = first % BLOCK_SIZE + tl.arange(0, BLOCK_N)
    else:
        if MASKED:  # entries of positions outside the range are never read
            block_ids = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0)
        else:
            block_ids = tl.load(block_table_row + key_pos // BLOCK_SIZE)
        slot_in_block = key_pos % BLOCK_SIZE
    return block_ids.to(tl.int64), slot_in_block


@triton.jit  # type: ignore[untyped-decorator]
def _attend_key_tile(  # type: ignore[no-untyped-def]
    acc, m_i, l_i, q, key_tile, key_start, key_end, row_ok, row_pos, row_key_end, kv_head,
    block_table_row, k_cache_ptr, v_cache_ptr, key_scale_ptr, inv_freq_ptr, rope_scaling,
    k_scale, v_scale, scale, softcap, sliding_window,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, KEY_FROM_VALUE: tl.constexpr, ROTARY_DIM: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    # One key tile into the running (acc, max, sum). MASKED tiles check every (row, key) pair;
    # the others are visible to every row of the query tile (below the diagonal, inside the
    # window, inside every row's key end): no mask but the head padding.
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    key_pos = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = (key_pos >= key_start) & (key_pos < key_end)
    block_ids, slot_in_block = _tile_blocks(
        block_table_row, key_tile, key_ok, BLOCK_N, BLOCK_SIZE, MASKED
    )
    if MASKED:
        k_mask = key_ok[None, :] & dim_ok[:, None]
        v_mask = key_ok[:, None] & dim_ok[None, :]
    else:
        k_mask = (key_pos >= 0)[None, :] & dim_ok[:, None]
        v_mask = (key_pos >= 0)[:, None] & dim_ok[None, :]
    v_offs = block_ids * stride_vb + slot_in_block * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_offs[:, None] + dims[None, :], mask=v_mask, other=0.0)
    if KV_FP8:  # fp8 pages: dequantized in fp32, then in the query dtype for the products
        v = v.to(tl.float32) * v_scale
    if KEY_FROM_VALUE:
        k = _rotate_values_into_keys(
            v, v_cache_ptr, v_offs, k_mask, key_pos, dims, dim_ok, key_scale_ptr,
            inv_freq_ptr, rope_scaling, v_scale, ROTARY_DIM,
        ).to(q.dtype)  # fmt: skip
    else:
        k_offs = block_ids * stride_kb + slot_in_block * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_offs[None, :] + dims[:, None], mask=k_mask, other=0.0)
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
    if KV_FP8:
        v = v.to(q.dtype)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
    if HAS_SOFTCAP:
        scores = softcap * _tanh(scores / softcap)
    if MASKED:
        is_visible = row_ok[:, None] & key_ok[None, :] & (key_pos[None, :] < row_key_end[:, None])
        if HAS_WINDOW:
            is_visible = is_visible & (row_pos[:, None] - key_pos[None, :] < sliding_window)
        scores = tl.where(is_visible, scores, float("-inf"))

    # Online softmax; rows that have seen no key yet keep m = -inf, so shift by 0 there
    # (an unmasked tile gives every row a finite score).
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_shift = m_new
    if MASKED:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    probs = tl.exp2((scores - m_shift[:, None]) * _LOG2E)
    alpha = tl.exp2((m_i - m_shift) * _LOG2E)
    l_i = l_i * alpha + tl.sum(probs, 1)
    acc = acc * alpha[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit  # type: ignore[untyped-decorator]
def _unmasked_tiles(  # type: ignore[no-untyped-def]
    row_ok, row_key_end, context_len, q_local, q_len, sliding_window, tile_begin, tile_end,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_KEY_ENDS: tl.constexpr,
):  # fmt: skip
    # [lo, hi) inside [tile_begin, tile_end): the key tiles every row of the query tile sees
    # whole: below the first row's key end (the diagonal), and with a window, at or above the
    # last row's window start. The tiles around them are masked.
    first_row_end = context_len + q_local + 1
    if HAS_KEY_ENDS:
        first_row_end = tl.min(tl.where(row_ok, row_key_end, 2147483647), 0)
    hi = first_row_end // BLOCK_N
    lo = tl.zeros((), tl.int32)
    if HAS_WINDOW:
        last_row_pos = context_len + tl.minimum(q_local + BLOCK_Q, q_len) - 1
        lo = tl.cdiv(tl.maximum(last_row_pos - sliding_window + 1, 0), BLOCK_N)
    lo = tl.minimum(tl.maximum(lo, tile_begin), tile_end)
    hi = tl.minimum(tl.maximum(hi, lo), tile_end)
    return lo, hi


@triton.jit  # type: ignore[untyped-decorator]
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    sinks_ptr, key_scale_ptr, inv_freq_ptr, rope_scaling, k_scale_ptr, v_scale_ptr, key_ends_ptr,
    scale, softcap, sliding_window, num_reqs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, KEY_FROM_VALUE: tl.constexpr, ROTARY_DIM: tl.constexpr,
    DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_KEY_ENDS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, num_reqs, tile_idx, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_local = (tile_idx - q_start // BLOCK_Q - req) * BLOCK_Q  # first token of the tile
    if q_local >= q_len:
        return
    context_len = tl.load(seq_lens_ptr + req) - q_len

    # Query tile [BLOCK_M, HEAD_PAD]; padding rows and columns load 0 and are never stored.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    row_token = q_local + rows // GROUP_PAD
    row_head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows % GROUP_PAD < GROUP) & (row_token < q_len)
    row_pos = context_len + row_token
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q_offs = (q_start + row_token)[:, None] * stride_qt + row_head[:, None] * stride_qh
    q = tl.load(q_ptr + q_offs + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys this tile may see: [key_start, key_end); tiles outside the window are not visited.
    # Each row sees keys below its own end: its position + 1, or further (`key_ends`).
    key_end = tl.minimum(context_len + q_local + BLOCK_Q, context_len + q_len)
    row_key_end = row_pos + 1
    if HAS_KEY_ENDS:
        row_key_end = tl.load(key_ends_ptr + q_start + row_token, mask=row_ok, other=0)
        key_end = tl.max(row_key_end, 0)
    key_start = 0
    if HAS_WINDOW:
        key_start = tl.maximum(context_len + q_local - sliding_window + 1, 0)
    first_tile = key_start // BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(key_end, BLOCK_N) - first_tile, NUM_SPLITS)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, tl.cdiv(key_end, BLOCK_N))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:
        # The sink is one more softmax term with no value: start the running max at the sink
        # logit and the running sum at exp(0) = 1. Only split 0 counts it (merged once).
        has_sink = row_ok & (split == 0)
        sink = tl.load(sinks_ptr + row_head, mask=has_sink, other=float("-inf")).to(tl.float32)
        m_i = tl.where(has_sink, sink, m_i)
        l_i = tl.where(has_sink, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    lo, hi = _unmasked_tiles(
        row_ok, row_key_end, context_len, q_local, q_len, sliding_window, tile_begin, tile_end,
        BLOCK_Q, BLOCK_N, HAS_WINDOW, HAS_KEY_ENDS,
    )  # fmt: skip
    for key_tile in range(lo, hi):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, key_tile, key_start, key_end, row_ok, row_pos, row_key_end, kv_head,
            block_table_row, k_cache_ptr, v_cache_ptr, key_scale_ptr, inv_freq_ptr, rope_scaling,
            k_scale, v_scale, scale, softcap, sliding_window,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            HEAD_SIZE, HEAD_PAD,
            BLOCK_N, BLOCK_SIZE, False, HAS_WINDOW, HAS_SOFTCAP, KEY_FROM_VALUE, ROTARY_DIM,
            DOT_FP32, DOT_PRECISION, KV_FP8,
        )  # fmt: skip
    # The masked tiles: the window's edge [tile_begin, lo), then the diagonal [hi, tile_end).
    num_before = lo - tile_begin
    for step in range(0, num_before + tile_end - hi):
        key_tile = tl.where(step < num_before, tile_begin + step, hi + step - num_before)
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, key_tile, key_start, key_end, row_ok, row_pos, row_key_end, kv_head,
            block_table_row, k_cache_ptr, v_cache_ptr, key_scale_ptr, inv_freq_ptr, rope_scaling,
            k_scale, v_scale, scale, softcap, sliding_window,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            HEAD_SIZE, HEAD_PAD,
            BLOCK_N, BLOCK_SIZE, True, HAS_WINDOW, HAS_SOFTCAP, KEY_FROM_VALUE, ROTARY_DIM,
            DOT_FP32, DOT_PRECISION, KV_FP8,
        )  # fmt: skip

    out_mask = row_ok[:, None] & dim_ok[None, :]
    tokens = q_start + row_token
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_offs = tokens[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials: [num_tokens, num_q_heads, NUM_SPLITS] (+ [HEAD_PAD] for acc), contiguous.
        part = (tokens * (tl.num_programs(1) * GROUP) + row_head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=out_mask)


@triton.jit  # type: ignore[untyped-decorator]
def _merge_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, stride_ot, stride_oh,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    part_max = tl.load(part_max_ptr + part)
    max_all = tl.max(part_max, 0)
    max_all = tl.where(max_all == float("-inf"), 0.0, max_all)
    weight = tl.exp2((part_max - max_all) * _LOG2E)  # 0 for empty splits (max = -inf)
    total = tl.sum(tl.load(part_sum_ptr + part) * weight, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    out_offs = token * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_SIZE)


def choose_launch_config(
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    device: torch.device,
    keys_from_values: bool = False,
) -> LaunchConfig:
    """Tile sizes from host-known sizes only (no device sync).

    Batches with one token per request are treated as decodes: small query tiles and, on a
    GPU with more SMs than (request, KV head) pairs, the key range split across programs.
    """
    group_pad = triton.next_power_of_2(group)
    is_decode = num_tokens <= num_reqs
    block_m = max(16, group_pad) if is_decode else max(64, group_pad)
    block_n = 64 if head_size <= 128 else 32
    if head_size > 256:  # Gemma 4's global heads: keep the fp32 accumulator tile small
        block_m, block_n = max(16, group_pad), 16
    if not is_decode and head_size <= 128 and not keys_from_values:
        # Prefill at head <= 128: 128-row tiles over 8 warps with two stages measured 1.13x
        # the 64-row, 4-warp, 3-stage tiles on an H200 (docs/benchmarks.md, GPU check). Keys
        # rebuilt from values gave wrong results with these tiles there (Triton 3.6), so they
        # keep the smaller ones.
        return LaunchConfig(max(128, group_pad) // group_pad, block_n, 1, num_warps=8, num_stages=2)
    num_splits = 1
    if is_decode and device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = max(1, num_reqs * num_kv_heads)
        if programs < num_sms:
            num_splits = min(16, triton.next_power_of_2(math.ceil(2 * num_sms / programs)))
    return LaunchConfig(block_q=block_m // group_pad, block_n=block_n, num_splits=num_splits)


def paged_attention(  # the signature shared by every backend
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
    *,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """Paged attention of a mixed batch; same contract as `kernels.reference.paged_attention`.

    `launch` overrides the tile sizes and KV splits (tests use it to reach every path).
    NOTE: output rows past `query_start_loc[-1]` (padding of a captured batch) are not written.
    """
    check_attention_args(query, key_cache, value_cache, block_table, sliding_window, softcap, sinks)
    check_key_from_value(key_from_value, query.shape[2])
    check_key_ends(key_ends, query.shape[0])
    assert query.stride(2) == 1, "head_size must be contiguous"
    assert key_cache.stride(3) == 1, "head_size must be contiguous"
    assert value_cache.stride(3) == 1, "head_size must be contiguous"
    assert block_table.stride(1) == 1, "block-table rows must be contiguous"
    num_tokens, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    num_reqs = seq_lens.shape[0]
    group = num_q_heads // num_kv_heads
    if launch is None:
        launch = choose_launch_config(
            num_tokens, num_reqs, num_kv_heads, group, head_size, query.device,
            keys_from_values=key_from_value is not None,
        )  # fmt: skip
    output = torch.empty_like(query)
    if num_reqs == 0 or num_tokens == 0:
        return output
    head_pad = max(16, triton.next_power_of_2(head_size))
    partials = _allocate_partials(output, launch.num_splits, head_pad)
    is_fp32 = query.dtype == torch.float32
    derived = _key_from_value_args(key_from_value, output)
    k_scale, v_scale = scale_tensors(kv_scales, query.device)
    grid = (num_tokens // launch.block_q + num_reqs, num_kv_heads, launch.num_splits)
    _paged_attention_kernel[grid](
        output, *partials,
        query, key_cache, value_cache, block_table, query_start_loc.contiguous(),
        seq_lens.contiguous(), output if sinks is None else sinks.float().contiguous(),
        *derived[:3], k_scale, v_scale,
        output if key_ends is None else key_ends.to(torch.int32).contiguous(),
        scale, softcap or 1.0, sliding_window or 1, num_reqs,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1), block_table.stride(0),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_SIZE=head_size,
        HEAD_PAD=head_pad, BLOCK_Q=launch.block_q, BLOCK_N=launch.block_n,
        NUM_SPLITS=launch.num_splits, HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        KEY_FROM_VALUE=key_from_value is not None, ROTARY_DIM=derived[3],
        DOT_FP32=is_interpreted() or is_fp32,
        DOT_PRECISION="ieee" if is_fp32 else "tf32", KV_FP8=is_fp8(key_cache.dtype),
        HAS_KEY_ENDS=key_ends is not None, BLOCK_SIZE=key_cache.shape[1],
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    if launch.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            output, *partials, output.stride(0), output.stride(1),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=launch.num_splits,
        )  # fmt: skip
    return output


def _key_from_value_args(
    key_from_value: KeyFromValue | None, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(scale, inv_freq, rope scaling, rotary dim) kernel arguments; dummies without one."""
    if key_from_value is None:
        return output, output, 1.0, 2
    scale = key_from_value.scale.float().to(output.device).contiguous()
    inv_freq = key_from_value.inv_freq.float().to(output.device).contiguous()
    return scale, inv_freq, key_from_value.attention_scaling, 2 * inv_freq.numel()


def _allocate_partials(
    output: torch.Tensor, num_splits: int, head_pad: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (acc, running max, running sum) per (token, query head, split); dummies if unsplit."""
    if num_splits == 1:
        dummy = torch.empty(1, dtype=torch.float32, device=output.device)
        return dummy, dummy, dummy
    num_tokens, num_q_heads, _ = output.shape
    shape = (num_tokens, num_q_heads, num_splits)
    stats = torch.empty(shape, dtype=torch.float32, device=output.device)
    acc = torch.empty((*shape, head_pad), dtype=torch.float32, device=output.device)
    return acc, stats, torch.empty_like(stats)

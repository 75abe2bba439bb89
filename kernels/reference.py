"""Plain-PyTorch paged KV-cache kernels: the oracle every backend is tested against, and on CPU
the cache store and prefill path of the batched kernel (`batched_attention`, the CPU default).

Called through the backend registry; every other backend has the same signatures. Caches use
the paged layout `[num_blocks, block_size, num_kv_heads, head_size]`, in the model dtype or in
fp8 with per-layer scales (`kernels.kv_quant`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.kv_quant import KVScales, dequantize, quantize, split_scales

# Upper bound on the fp32 score elements of one matmul; long prefills are cut into query
# chunks so that a CPU prefill of thousands of tokens does not allocate gigabytes of scores.
_MAX_SCORE_ELEMENTS = 1 << 24


class KeyFromValue(NamedTuple):
    """Keys rebuilt from the cached values, for layers that store one tensor (Gemma 4's global
    layers, whose keys and values come from one projection).

    The key of the token at position `p` is `rope_p(value * scale)`: rotate-half rope over the
    first `2 * len(inv_freq)` features with angles `p * inv_freq` and cos/sin multiplied by
    `attention_scaling`; the other features are only scaled. Given to `paged_attention`, it
    makes the kernel read keys from `value_cache` and ignore `key_cache`.
    """

    scale: torch.Tensor  # [head_size]
    inv_freq: torch.Tensor  # fp32 [rotary_dim // 2]
    attention_scaling: float = 1.0


class PagedKV(NamedTuple):
    """The caches plus one request's row of the block table."""

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    block_ids: torch.Tensor  # [max_blocks] int32
    key_from_value: KeyFromValue | None = None
    kv_scales: KVScales | None = None
    """fp8 caches: the scales their pages are read with (None: 1.0)."""


class ScoreRule(NamedTuple):
    """How raw scores become logits: scale, then optional softcap, then causal/window mask;
    optional per-query-head sink logits join the softmax denominator only."""

    scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None = None  # fp32 [num_q_heads]


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_size]` into the caches in place.

    Token `t` goes to `slot_mapping[t] = block_id * block_size + offset`; slot -1 skips it.
    The caches may be strided views into a shared buffer; indexing writes through the view.
    fp8 caches store `key / kv_scales.key` and `value / kv_scales.value`, clamped (1.0 when
    `kv_scales` is None; `kernels.kv_quant.quantize`).
    """
    check_store_args(key, value, key_cache, value_cache, slot_mapping)
    key_scale, value_scale = split_scales(kv_scales)
    block_size = key_cache.shape[1]
    is_stored = slot_mapping >= 0
    slots = slot_mapping[is_stored].long()
    block_ids, offsets = slots // block_size, slots % block_size
    key_cache[block_ids, offsets] = quantize(key[is_stored], key_scale, key_cache.dtype)
    value_cache[block_ids, offsets] = quantize(value[is_stored], value_scale, value_cache.dtype)


def paged_attention(  # noqa: PLR0913 (the signature shared by every backend)
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
) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks and decodes) over a paged KV cache.

    Request `i` owns `query[query_start_loc[i]:query_start_loc[i + 1]]`, its newest tokens out
    of `seq_lens[i]`. `sinks` [num_q_heads] are learned logits that take part in each query
    head's softmax denominator but have no value (attention sinks, gpt-oss): the weights of
    the keys then sum to less than one. `key_from_value`: the keys are derived from the values
    (see `KeyFromValue`; rebuilt from values read with the value scale). `kv_scales`: fp8
    pages are read as `fp8.float() * scale` (1.0 when None). `key_ends` [num_tokens] int32: per
    query row, one past the last key position it sees (see `check_key_ends`; None: causal).
    Returns `[num_tokens, num_q_heads, head_size]` in the query dtype.
    """
    check_attention_args(query, key_cache, value_cache, block_table, sliding_window, softcap, sinks)
    check_key_from_value(key_from_value, query.shape[2])
    check_key_ends(key_ends, query.shape[0])
    output = torch.zeros_like(query)
    rule = ScoreRule(scale, sliding_window, softcap, None if sinks is None else sinks.float())
    starts = query_start_loc.tolist()
    for req_idx, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[req_idx], starts[req_idx + 1]
        if end > start:
            paged = PagedKV(key_cache, value_cache, block_table[req_idx], key_from_value, kv_scales)
            ends = None if key_ends is None else key_ends[start:end]
            output[start:end] = attend_request(query[start:end], seq_len, paged, rule, ends)
    return output


def attend_request(
    query: torch.Tensor,
    seq_len: int,
    paged: PagedKV,
    rule: ScoreRule,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request's attention: `query` `[q_len, num_q_heads, head_size]` holds its newest
    tokens out of `seq_len` (`key_ends`: its rows' key ends, None: causal); long queries go in
    row chunks under the score budget."""
    q_len = query.shape[0]
    context_len = seq_len - q_len
    rows = _chunk_rows(query.shape[1], seq_len)
    if rows >= q_len:
        return _attend(query, context_len, paged, rule, key_ends)
    output = torch.empty_like(query)
    for chunk_start in range(0, q_len, rows):
        chunk_end = min(chunk_start + rows, q_len)
        chunk = query[chunk_start:chunk_end]
        ends = None if key_ends is None else key_ends[chunk_start:chunk_end]
        output[chunk_start:chunk_end] = _attend(chunk, context_len + chunk_start, paged, rule, ends)
    return output


def check_store_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Assert the shapes `store_kv_cache` relies on (shared by every backend)."""
    assert key.dim() == 3, key.shape
    assert key.shape == value.shape, (key.shape, value.shape)
    assert key_cache.dim() == 4, key_cache.shape
    assert key_cache.shape == value_cache.shape, (key_cache.shape, value_cache.shape)
    assert key_cache.dtype == value_cache.dtype, (key_cache.dtype, value_cache.dtype)
    assert key_cache.shape[2:] == key.shape[1:], (key_cache.shape, key.shape)
    assert slot_mapping.shape == (key.shape[0],), slot_mapping.shape


def check_attention_args(  # noqa: PLR0913 (every argument of the kernel signature)
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Assert the shapes `paged_attention` relies on (shared by every backend)."""
    assert query.dim() == 3, query.shape
    assert key_cache.dim() == 4, key_cache.shape
    assert key_cache.shape == value_cache.shape, (key_cache.shape, value_cache.shape)
    assert query.shape[2] == key_cache.shape[3], (query.shape, key_cache.shape)
    assert query.shape[1] % key_cache.shape[2] == 0, "num_q_heads % num_kv_heads != 0"
    assert block_table.dim() == 2, block_table.shape
    assert sliding_window is None or sliding_window >= 1, sliding_window
    assert softcap is None or softcap > 0, softcap
    assert sinks is None or sinks.shape == (query.shape[1],), "sinks: one logit per query head"


def check_key_ends(key_ends: torch.Tensor | None, num_tokens: int) -> None:
    """Assert the shape of `key_ends` (shared by every backend that accepts it).

    `key_ends[t]` is one past the last key position query row `t` sees: its position + 1 for a
    causal row, more for a row that also sees later keys (the tokens of one image attending to
    each other both ways, Gemma 3). A sliding window still bounds keys from below. Every key
    below a row's end must be in the cache this step (its request's `seq_lens`).
    """
    if key_ends is None:
        return
    assert key_ends.shape == (num_tokens,), (key_ends.shape, num_tokens)


def check_key_from_value(key_from_value: KeyFromValue | None, head_size: int) -> None:
    """Assert the shapes of a `KeyFromValue` (shared by every backend that accepts one)."""
    if key_from_value is None:
        return
    assert key_from_value.scale.shape == (head_size,), "scale: one factor per feature"
    rotary_dim = 2 * key_from_value.inv_freq.numel()
    assert 2 <= rotary_dim <= head_size, f"rotary dim {rotary_dim} vs head_size {head_size}"


def rotate_values_into_keys(
    values: torch.Tensor, positions: torch.Tensor, key_from_value: KeyFromValue
) -> torch.Tensor:
    """fp32 keys `[n, heads, head_size]` of fp32 `values` at `positions` `[n]` (see
    `KeyFromValue`); cos/sin computed as the models' rope tables are."""
    scaled = values * key_from_value.scale.float().to(values.device)
    inv_freq = key_from_value.inv_freq.float().to(values.device)
    half = inv_freq.numel()
    freqs = positions[:, None].float() * inv_freq  # [n, half]: both halves share the angles
    cos = (freqs.cos() * key_from_value.attention_scaling)[:, None, :]
    sin = (freqs.sin() * key_from_value.attention_scaling)[:, None, :]
    first, second = scaled[..., :half], scaled[..., half : 2 * half]
    passed = scaled[..., 2 * half :]  # features past the rotary dims are only scaled
    return torch.cat((first * cos - second * sin, second * cos + first * sin, passed), dim=-1)


def _chunk_rows(num_q_heads: int, seq_len: int) -> int:
    """Query rows per matmul so that one chunk's scores stay under the element budget."""
    return max(1, _MAX_SCORE_ELEMENTS // (num_q_heads * max(seq_len, 1)))


def _attend(
    query: torch.Tensor,
    first_pos: int,
    paged: PagedKV,
    rule: ScoreRule,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` `[q_len, num_q_heads, head_size]`, first token at `first_pos`
    (`key_ends`: each row's key end, None: causal).

    Only blocks that hold keys some query may see are gathered, so block-table entries of
    blocks wholly outside the sliding window are never read.
    """
    q_len = query.shape[0]
    key_start = 0 if rule.sliding_window is None else max(0, first_pos - rule.sliding_window + 1)
    query_pos = torch.arange(first_pos, first_pos + q_len, device=query.device)[:, None]
    row_ends = query_pos + 1 if key_ends is None else key_ends.to(query.device).long()[:, None]
    key_end = first_pos + q_len if key_ends is None else int(row_ends.max())
    keys, values = _gather_keys(paged, key_start, key_end)  # [num_kv_heads, num_keys, head_size]
    key_pos = torch.arange(key_start, key_end, device=query.device)[None, :]
    is_visible = key_pos < row_ends  # [q_len, num_keys]
    if rule.sliding_window is not None:
        is_visible &= query_pos - key_pos < rule.sliding_window
    q = query.float().transpose(0, 1)  # [num_q_heads, q_len, head_size]
    if rule.softcap is None and rule.sinks is None and q_len > 1:
        # Fused masked attention: on CPU about 2x faster than the explicit form for several
        # query rows, and it never materialises the scores.
        out = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], is_visible, scale=rule.scale, enable_gqa=True
        )[0]
    else:  # single-token decodes (faster explicit), softcap and sinks (SDPA cannot express them)
        out = _explicit_attention(q, keys, values, is_visible, rule)
    return out.transpose(0, 1).to(query.dtype)


def _explicit_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    is_visible: torch.Tensor,
    rule: ScoreRule,
) -> torch.Tensor:
    """Masked attention as two matmuls, with optional `softcap * tanh(scores / softcap)` and
    sink logits (an extra softmax column per query head whose weight is dropped)."""
    num_q_heads, q_len, head_size = q.shape
    num_kv_heads = keys.shape[0]
    group = num_q_heads // num_kv_heads
    # [num_kv_heads, group * q_len, head_size]: all query heads of one KV head in one matmul.
    scores = torch.matmul(q.reshape(num_kv_heads, group * q_len, head_size), keys.mT)
    scores = scores.view(num_kv_heads, group, q_len, -1) * rule.scale
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    scores = scores.masked_fill(~is_visible, float("-inf"))
    if rule.sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sinks = rule.sinks.to(scores.device).view(num_kv_heads, group, 1, 1)
        sink_column = sinks.expand(num_kv_heads, group, q_len, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.matmul(probs.reshape(num_kv_heads, group * q_len, -1), values)
    return out.view(num_q_heads, q_len, head_size)


def _gather_keys(paged: PagedKV, key_start: int, key_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values at positions `[key_start, key_end)`, fp32 `[num_kv_heads, n, head_size]`
    (fp8 pages dequantized with their scales)."""
    block_size = paged.key_cache.shape[1]
    first_block = key_start // block_size
    last_block = (key_end - 1) // block_size
    block_ids = paged.block_ids[first_block : last_block + 1].long()
    skip = key_start - first_block * block_size
    num_keys = key_end - key_start

    key_scale, value_scale = split_scales(paged.kv_scales)

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        # index_select (not advanced indexing): several times faster on CPU
        pages = cache.index_select(0, block_ids).flatten(0, 1)[skip : skip + num_keys]
        return dequantize(pages, scale)  # [n, heads, size]

    values = gather(paged.value_cache, value_scale)
    if paged.key_from_value is None:
        keys = gather(paged.key_cache, key_scale)
    else:
        positions = torch.arange(key_start, key_end, device=values.device)
        keys = rotate_values_into_keys(values, positions, paged.key_from_value)
    return keys.transpose(0, 1), values.transpose(0, 1)  # [heads, n, size]

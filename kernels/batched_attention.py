"""Batched plain-PyTorch paged attention: the serving path on CPU (backend "torch").

Same contract as `kernels.reference.paged_attention`, which stays the oracle it is tested
against. Every single-token decode of a step is served by one gather of its keys and values
and one batched product; prefill chunks (several query rows) go through the reference's
per-request path, which runs fused `scaled_dot_product_attention` on their contiguous K/V.

    decodes sorted by key span -> chunks under the element budget -> per chunk:
    key rows [D, L] (clamped into each request's span) -> index_select -> [D, L, kv, size]
    -> scores [D, kv, group, L] (masked past each span) -> softmax -> out [D, q_heads, size]
"""

from __future__ import annotations

import torch

from kernels.reference import (
    KeyFromValue,
    PagedKV,
    ScoreRule,
    attend_request,
    check_attention_args,
    check_key_from_value,
    rotate_values_into_keys,
)

# Upper bound on gathered key elements of one decode chunk (64 MiB of fp32 keys).
_MAX_GATHER_ELEMENTS = 1 << 24


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
) -> torch.Tensor:
    """Causal attention of a mixed batch over a paged KV cache; see the reference."""
    check_attention_args(query, key_cache, value_cache, block_table, sliding_window, softcap, sinks)
    check_key_from_value(key_from_value, query.shape[2])
    rule = ScoreRule(scale, sliding_window, softcap, None if sinks is None else sinks.float())
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    output = torch.zeros_like(query)
    decodes: list[int] = []
    for req_idx, seq_len in enumerate(lengths):
        start, end = starts[req_idx], starts[req_idx + 1]
        if end - start == 1:
            decodes.append(req_idx)
        elif end > start:
            paged = PagedKV(key_cache, value_cache, block_table[req_idx], key_from_value)
            output[start:end] = attend_request(query[start:end], seq_len, paged, rule)
    if decodes:
        paged = PagedKV(key_cache, value_cache, block_table, key_from_value)
        spans = [_key_span(lengths[idx], sliding_window) for idx in decodes]
        for chunk in _decode_chunks(decodes, spans, key_cache.shape[2] * key_cache.shape[3]):
            rows = torch.tensor([starts[idx] for idx in chunk], device=query.device)
            ends = torch.tensor([lengths[idx] for idx in chunk], device=query.device)
            output[rows] = _decode(query[rows], block_table[chunk], ends, paged, rule)
    return output


def _key_span(seq_len: int, sliding_window: int | None) -> int:
    """Keys a decode at position `seq_len - 1` sees."""
    return seq_len if sliding_window is None else min(seq_len, sliding_window)


def _decode_chunks(decodes: list[int], spans: list[int], row_elements: int) -> list[list[int]]:
    """Decodes sorted by span, cut so that no chunk gathers more than the element budget."""
    order = sorted(range(len(decodes)), key=spans.__getitem__)
    chunks: list[list[int]] = [[]]
    for pos in order:
        # Sorted ascending: this decode's span is the widest of the chunk it joins.
        if chunks[-1] and (len(chunks[-1]) + 1) * spans[pos] * row_elements > _MAX_GATHER_ELEMENTS:
            chunks.append([])
        chunks[-1].append(decodes[pos])
    return chunks


def _decode(
    query: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    paged: PagedKV,
    rule: ScoreRule,
) -> torch.Tensor:
    """Single-token decodes: `query` `[D, num_q_heads, head_size]`, request `d` at position
    `seq_lens[d] - 1` with the block-table row `block_table[d]`."""
    num_decodes, num_q_heads, head_size = query.shape
    num_kv_heads = paged.value_cache.shape[2]
    group = num_q_heads // num_kv_heads
    window = seq_lens if rule.sliding_window is None else seq_lens.clamp(max=rule.sliding_window)
    key_start = seq_lens - window  # [D]
    span = int(window.max())
    offsets = torch.arange(span, device=query.device)
    is_visible = offsets[None, :] < window[:, None]  # [D, L]
    # Out-of-span columns repeat the request's last key, so only cached slots are read.
    positions = key_start[:, None] + torch.minimum(offsets[None, :], window[:, None] - 1)
    keys, values = _gather(paged, block_table, positions)  # [D, num_kv_heads, L, head_size]
    q = query.float().view(num_decodes, num_kv_heads, group, head_size)
    scores = torch.matmul(q, keys.mT) * rule.scale  # [D, num_kv_heads, group, L]
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    scores = scores.masked_fill(~is_visible[:, None, None, :], float("-inf"))
    if rule.sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sinks = rule.sinks.to(scores.device).view(1, num_kv_heads, group, 1)
        sink_column = sinks.expand(num_decodes, num_kv_heads, group, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.matmul(probs, values)  # [D, num_kv_heads, group, head_size]
    return out.view(num_decodes, num_q_heads, head_size).to(query.dtype)


def _gather(
    paged: PagedKV, block_table: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys and values of `positions` `[D, L]`, as `[D, num_kv_heads, L, head_size]`."""
    block_size = paged.value_cache.shape[1]
    block_ids = torch.gather(block_table.long(), 1, positions // block_size)
    offsets = positions % block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows, rows_per_block = _token_rows(cache)
        picked = rows.index_select(0, (block_ids * rows_per_block + offsets).flatten())
        return picked.view(*positions.shape, *cache.shape[2:]).float()  # [D, L, heads, size]

    values = gather(paged.value_cache)
    if paged.key_from_value is None:
        keys = gather(paged.key_cache)
    else:
        flat = values.flatten(0, 1)
        keys = rotate_values_into_keys(flat, positions.flatten(), paged.key_from_value)
        keys = keys.view(values.shape)
    return keys.transpose(1, 2), values.transpose(1, 2)


def _token_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A `[rows, num_kv_heads, head_size]` view of the cache's storage where token `offset` of
    block `b` is row `b * rows_per_block + offset`, without copying strided caches (K and V
    pages interleaved in one buffer)."""
    num_blocks, block_size, num_heads, head_size = cache.shape
    block_stride, token_stride = cache.stride(0), cache.stride(1)
    is_row_layout = cache.stride(2) == head_size and cache.stride(3) == 1
    if is_row_layout and token_stride == num_heads * head_size and block_stride % token_stride == 0:
        rows_per_block = block_stride // token_stride
        num_rows = (num_blocks - 1) * rows_per_block + block_size
        rows = cache.as_strided((num_rows, num_heads, head_size), (token_stride, head_size, 1))
        return rows, rows_per_block
    return cache.reshape(num_blocks * block_size, num_heads, head_size), block_size

"""Batched plain-PyTorch paged attention (backend "torch"; the CPU default, see the registry).

Same contract as `kernels.reference.paged_attention`, which stays the oracle it is tested
against. The single-token decodes of a step are served in a few chunks, each one gather of
whole cache blocks and one batched product per KV head; prefill chunks (several query rows) and
a lone request go through the reference's per-request path (fused
`scaled_dot_product_attention` on contiguous K/V).

    decodes sorted by key span -> chunks under the element budget -> per chunk:
    block ids [D, B] (past a request's last block: its last) -> index_select -> [D, L, kv, size]
    values outside each request's keys zeroed -> per KV head: bmm -> scores [D, group, L]
    (masked) -> softmax -> bmm -> out [D, q_heads, size]
"""

from __future__ import annotations

import torch

from kernels.kv_quant import KVScales, dequantize, split_scales
from kernels.reference import (
    KeyFromValue,
    PagedKV,
    ScoreRule,
    attend_request,
    check_attention_args,
    check_key_ends,
    check_key_from_value,
    rotate_values_into_keys,
)

# Upper bound on gathered key elements of one decode chunk (1 MiB of fp32 keys): on CPU, chunks
# that stay in cache between the gather and the products beat one large gather (measured).
_MAX_GATHER_ELEMENTS = 1 << 18


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
    """Causal attention of a mixed batch over a paged KV cache; see the reference.

    `key_ends` reach the prefill chunks only: a single-token query sees up to itself anyway
    (an image of one token ends at that token's position + 1).
    """
    check_attention_args(query, key_cache, value_cache, block_table, sliding_window, softcap, sinks)
    check_key_from_value(key_from_value, query.shape[2])
    check_key_ends(key_ends, query.shape[0])
    rule = ScoreRule(scale, sliding_window, softcap, None if sinks is None else sinks.float())
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    output = torch.zeros_like(query)
    decodes: list[int] = []
    for req_idx, seq_len in enumerate(lengths):
        start, end = starts[req_idx], starts[req_idx + 1]
        if end - start == 1 and len(lengths) > 1:
            decodes.append(req_idx)
        elif end > start:  # prefill chunks, and a lone request (batch 1: the reference path)
            paged = PagedKV(key_cache, value_cache, block_table[req_idx], key_from_value, kv_scales)
            ends = None if key_ends is None else key_ends[start:end]
            output[start:end] = attend_request(query[start:end], seq_len, paged, rule, ends)
    if decodes:
        paged = PagedKV(key_cache, value_cache, block_table, key_from_value, kv_scales)
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
    keys, values, is_visible = _gather(paged, block_table, seq_lens, rule.sliding_window)
    q = query.float().view(num_decodes, num_kv_heads, group, head_size)
    # One batched product per KV head on strided views of the gathered pages (no copies):
    # [D, group, head_size] x [D, head_size, L] -> scores [D, num_kv_heads, group, L].
    scores = torch.stack([torch.bmm(q[:, h], keys[:, :, h].mT) for h in range(num_kv_heads)], dim=1)
    scores *= rule.scale
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    scores.masked_fill_(~is_visible[:, None, None, :], float("-inf"))
    if rule.sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sinks = rule.sinks.to(scores.device).view(1, num_kv_heads, group, 1)
        sink_column = sinks.expand(num_decodes, num_kv_heads, group, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.stack(
        [torch.bmm(probs[:, h], values[:, :, h]) for h in range(num_kv_heads)], dim=1
    )  # [D, num_kv_heads, group, head_size]
    return out.view(num_decodes, num_q_heads, head_size).to(query.dtype)


def _gather(
    paged: PagedKV, block_table: torch.Tensor, seq_lens: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 keys and values `[D, L, num_kv_heads, head_size]` of whole cache blocks (fp8 pages
    dequantized), from the first block in each request's window, and which of the L slots each
    request sees `[D, L]`.

    Block-table entries past a request's last block are replaced by its last block, and the
    values of slots it does not see are zeroed, so nothing outside its keys reaches the output
    (stale slots may hold anything, NaN included).
    """
    block_size = paged.value_cache.shape[1]
    key_start = seq_lens if window is None else seq_lens - seq_lens.clamp(max=window)
    key_start = seq_lens - seq_lens if window is None else key_start
    first_block = key_start // block_size  # [D]
    last_block = (seq_lens - 1) // block_size
    num_blocks = int((last_block - first_block).max()) + 1
    steps = torch.arange(num_blocks, device=seq_lens.device)
    logical = torch.minimum(first_block[:, None] + steps[None, :], last_block[:, None])
    block_ids = torch.gather(block_table.long(), 1, logical).flatten()  # [D * num_blocks]
    positions = first_block[:, None] * block_size + torch.arange(
        num_blocks * block_size, device=seq_lens.device
    )  # [D, L]
    is_visible = (positions >= key_start[:, None]) & (positions < seq_lens[:, None])

    key_scale, value_scale = split_scales(paged.kv_scales)

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        pages = cache.index_select(0, block_ids)  # [D * num_blocks, block_size, heads, size]
        return dequantize(pages.view(len(seq_lens), -1, *cache.shape[2:]), scale)

    values = gather(paged.value_cache, value_scale)
    values.masked_fill_(~is_visible[:, :, None, None], 0.0)
    if paged.key_from_value is None:
        keys = gather(paged.key_cache, key_scale)
    else:
        flat = values.flatten(0, 1)
        keys = rotate_values_into_keys(flat, positions.flatten(), paged.key_from_value)
        keys = keys.view(values.shape)
    return keys, values, is_visible

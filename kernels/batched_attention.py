"""Batched plain-PyTorch paged attention (backend "torch"; the CPU default, see the registry).

Same contract as `kernels.reference.paged_attention`, which stays the oracle it is tested
against. The single-token decodes of a step are served in a few chunks, each one gather of
whole cache blocks and one batched product per KV head; prefill chunks (several query rows) and
a lone request go through the reference's per-request path (fused
`scaled_dot_product_attention` on contiguous K/V).

    decodes sorted by key span -> chunks under the element budget -> per chunk:
    block ids [D, B] (past a request's last block: its last) -> index_select -> [D, L, kv, size]
    values outside each request's keys zeroed -> one grouped-query matmul -> scores
    [D, kv, group, L] (masked) -> softmax -> matmul -> out [D, q_heads, size]

The decode gather plan (chunks, block ids, slot positions, hidden slots) depends only on the
step's batch, the window and the cache layout, so a caller passing `decode_plans` (a fresh dict
per step and attention group, see `worker.attention.attention_groups`) has it made by the first
layer and reused by the others; without it every call makes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    decode_plans: DecodePlans | None = None,
) -> torch.Tensor:
    """Causal attention of a mixed batch over a paged KV cache; see the reference.

    `key_ends` reach the prefill chunks only: a single-token query sees up to itself anyway
    (an image of one token ends at that token's position + 1). `decode_plans`: the step's
    gather plans, shared by calls with the same block table, query starts and sequence lengths.
    """
    check_attention_args(query, key_cache, value_cache, block_table, sliding_window, softcap, sinks)
    check_key_from_value(key_from_value, query.shape[2])
    check_key_ends(key_ends, query.shape[0])
    rule = ScoreRule(scale, sliding_window, softcap, None if sinks is None else sinks.float())
    layout = (key_cache.shape[1], key_cache.shape[2] * key_cache.shape[3])
    plan = _plan_for(decode_plans, block_table, query_start_loc, seq_lens, sliding_window, layout)
    paged = PagedKV(key_cache, value_cache, block_table, key_from_value, kv_scales)
    if not plan.prefills and len(plan.chunks) == 1 and plan.chunks[0].rows is None:
        return _decode(query, plan.chunks[0], paged, rule)  # every row one decode, in order
    output = torch.zeros_like(query)
    for req_idx in plan.prefills:
        start, end = plan.starts[req_idx], plan.starts[req_idx + 1]
        one = PagedKV(key_cache, value_cache, block_table[req_idx], key_from_value, kv_scales)
        ends = None if key_ends is None else key_ends[start:end]
        output[start:end] = attend_request(query[start:end], plan.lengths[req_idx], one, rule, ends)
    for chunk in plan.chunks:
        rows = chunk.rows if chunk.rows is not None else slice(None)
        output[rows] = _decode(query[rows], chunk, paged, rule)
    return output


@dataclass(frozen=True)
class DecodeChunk:
    """One gather of whole cache blocks for some single-token decodes."""

    rows: torch.Tensor | None
    """[D] query rows of the chunk; None: every row of the call, in order."""
    block_ids: torch.Tensor
    """[D * num_blocks] cache blocks gathered (past a request's last block: its last)."""
    positions: torch.Tensor
    """[D, L] key position of every gathered slot."""
    hidden: torch.Tensor
    """[D, L] gathered slots the request does not see (outside its keys or window)."""


@dataclass(frozen=True)
class DecodePlan:
    """How one step's batch is attended: per-request prefills and chunked decode gathers."""

    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    starts: list[int]
    lengths: list[int]
    prefills: list[int]
    chunks: list[DecodeChunk]

    def serves(self, block_table: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor) -> bool:
        """Whether the plan was made for exactly these step tensors."""
        return (
            self.block_table is block_table
            and self.query_start_loc is starts
            and self.seq_lens is lens
        )


DecodePlans = dict[tuple[int | None, int, int], DecodePlan]
"""A step's gather plans by (sliding window, block size, elements of one cache slot)."""


def _plan_for(
    plans: DecodePlans | None,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    layout: tuple[int, int],
) -> DecodePlan:
    """The plan in `plans` when it was made for these tensors, else a new one (then kept)."""
    key = (window, *layout)
    plan = None if plans is None else plans.get(key)
    if plan is None or not plan.serves(block_table, query_start_loc, seq_lens):
        plan = make_decode_plan(block_table, query_start_loc, seq_lens, window, layout)
        if plans is not None:
            plans[key] = plan
    return plan


def make_decode_plan(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    layout: tuple[int, int],
) -> DecodePlan:
    """Prefill requests and decode chunks of a step; `layout`: (block size, elements of one
    cache slot)."""
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    decodes: list[int] = []
    prefills: list[int] = []
    for req_idx in range(len(lengths)):
        start, end = starts[req_idx], starts[req_idx + 1]
        if end - start == 1 and len(lengths) > 1:
            decodes.append(req_idx)
        elif end > start:  # prefill chunks, and a lone request (batch 1: the reference path)
            prefills.append(req_idx)
    block_size, row_elements = layout
    spans = [_key_span(lengths[idx], window) for idx in decodes]
    cut = _decode_chunks(decodes, spans, row_elements) if decodes else []
    in_order = not prefills and len(cut) == 1 and starts == list(range(len(lengths) + 1))
    chunks = []
    for chunk in [decodes] if in_order else cut:
        rows = (
            None if in_order else torch.tensor([starts[i] for i in chunk], device=seq_lens.device)
        )
        ends = torch.tensor([lengths[i] for i in chunk], device=seq_lens.device)
        chunks.append(_chunk(rows, block_table[chunk], ends, window, block_size))
    return DecodePlan(block_table, query_start_loc, seq_lens, starts, lengths, prefills, chunks)


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
    query: torch.Tensor, chunk: DecodeChunk, paged: PagedKV, rule: ScoreRule
) -> torch.Tensor:
    """Single-token decodes `query` `[D, num_q_heads, head_size]` of one planned chunk."""
    num_decodes, num_q_heads, head_size = query.shape
    num_kv_heads = paged.value_cache.shape[2]
    group = num_q_heads // num_kv_heads
    keys, values = _gather(paged, chunk)
    q = query.float().view(num_decodes, num_kv_heads, group, head_size)
    # One grouped-query product on strided views of the gathered pages:
    # [D, kv, group, head_size] x [D, kv, head_size, L] -> scores [D, kv, group, L].
    scores = torch.matmul(q, keys.permute(0, 2, 3, 1))
    scores *= rule.scale
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    scores.masked_fill_(chunk.hidden[:, None, None, :], float("-inf"))
    if rule.sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sinks = rule.sinks.to(scores.device).view(1, num_kv_heads, group, 1)
        sink_column = sinks.expand(num_decodes, num_kv_heads, group, 1)
        probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.matmul(probs, values.transpose(1, 2))  # [D, kv, group, head_size]
    return out.reshape(num_decodes, num_q_heads, head_size).to(query.dtype)


def _chunk(
    rows: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    block_size: int,
) -> DecodeChunk:
    """The gather of whole cache blocks from the first block in each request's window.

    Block-table entries past a request's last block are replaced by its last block; slots a
    request does not see are hidden (values zeroed, scores masked), so nothing outside its keys
    reaches the output (stale slots may hold anything, NaN included).
    """
    key_start = seq_lens - seq_lens if window is None else seq_lens - seq_lens.clamp(max=window)
    first_block = key_start // block_size  # [D]
    last_block = (seq_lens - 1) // block_size
    num_blocks = int((last_block - first_block).max()) + 1
    steps = torch.arange(num_blocks, device=seq_lens.device)
    logical = torch.minimum(first_block[:, None] + steps[None, :], last_block[:, None])
    block_ids = torch.gather(block_table.long(), 1, logical).flatten()  # [D * num_blocks]
    positions = first_block[:, None] * block_size + torch.arange(
        num_blocks * block_size, device=seq_lens.device
    )  # [D, L]
    hidden = (positions < key_start[:, None]) | (positions >= seq_lens[:, None])
    return DecodeChunk(rows, block_ids, positions, hidden)


def _gather(paged: PagedKV, chunk: DecodeChunk) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys and values `[D, L, num_kv_heads, head_size]` of the chunk's cache blocks (fp8
    pages dequantized), hidden slots' values zeroed."""
    key_scale, value_scale = split_scales(paged.kv_scales)
    num_decodes = chunk.positions.shape[0]

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        pages = cache.index_select(0, chunk.block_ids)  # [D * blocks, block_size, heads, size]
        return dequantize(pages.view(num_decodes, -1, *cache.shape[2:]), scale)

    values = gather(paged.value_cache, value_scale)
    values.masked_fill_(chunk.hidden[:, :, None, None], 0.0)
    if paged.key_from_value is None:
        keys = gather(paged.key_cache, key_scale)
    else:
        flat = values.flatten(0, 1)
        keys = rotate_values_into_keys(flat, chunk.positions.flatten(), paged.key_from_value)
        keys = keys.view(values.shape)
    return keys, values

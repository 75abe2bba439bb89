"""Batch-invariant paged attention (backend "batch_invariant", the batch-invariant mode's kernel).

Same contract as `kernels.reference.paged_attention`. Every query row, prefill chunk or decode,
reads its keys in tiles fixed in absolute positions (`tile_keys` keys: whole cache blocks) and
folds them into an online softmax in tile order, each tile a product of one fixed shape. A
row's arithmetic then depends only on its own position, key end and window: not on the other
rows of the step, the chunk it was cut into, or whether its prefix came from the cache.

    row r (request i, position p): tiles first(r) .. last(r) of request i, in order
    per tile: gather [R, tile, kv, size] -> scores [R, kv, group, tile] (masked; softcap)
              (products as batched GEMMs of one problem shape per row and kv head: each
              problem is computed alike whatever the number of rows; a GEMM of all rows at
              once would pick its algorithm from that number)
              -> m' = max(m, tile max), l = l e^(m - m') + sum e^(s - m'), acc likewise + P V

Tiles past a row's last are fully masked: they add exact zeros and leave its max, so rows of
different lengths share the loop. Sinks enter as the first "key" (a logit with a zero value).
Values of keys a row does not see are zeroed (stale slots may hold NaN).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.batch_invariant import whole_vectors
from kernels.kv_quant import KVScales, dequantize, split_scales
from kernels.reference import (
    KeyFromValue,
    ScoreRule,
    check_attention_args,
    check_key_ends,
    check_key_from_value,
    rotate_values_into_keys,
)

TILE_KEYS = 32
"""Keys per tile, rounded up to whole cache blocks."""
_MAX_GATHER_ELEMENTS = 1 << 22
"""Bound on the product elements (rows x tile keys x query heads x head size) of one row chunk
(rows are independent, so chunking them changes nothing)."""


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
    """Attention of a mixed batch over a paged KV cache, each row computed the same way
    whatever the batch; see the reference for the arguments."""
    check_attention_args(query, key_cache, value_cache, block_table, sliding_window, softcap, sinks)
    check_key_from_value(key_from_value, query.shape[2])
    check_key_ends(key_ends, query.shape[0])
    # The products below are elementwise; exp and tanh are padded to whole vectors here.
    return _paged_attention(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        _Extras(scale, sliding_window, softcap, sinks, key_from_value, kv_scales, key_ends),
    )  # fmt: skip


class _Extras(NamedTuple):
    """The optional arguments of `paged_attention`, passed on as one."""

    scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    key_from_value: KeyFromValue | None
    kv_scales: KVScales | None
    key_ends: torch.Tensor | None


def _paged_attention(  # noqa: PLR0913 (the cache arguments of every backend)
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    extras: _Extras,
) -> torch.Tensor:
    scale, sliding_window, softcap, sinks, key_from_value, kv_scales, key_ends = extras
    rule = ScoreRule(scale, sliding_window, softcap, None if sinks is None else sinks.float())
    rows = _RowPlan.build(query_start_loc, seq_lens, key_ends, query.device)
    block_size = key_cache.shape[1]
    blocks_per_tile = max(1, -(-TILE_KEYS // block_size))
    row_elements = blocks_per_tile * block_size * query.shape[1] * query.shape[2]
    chunk = max(1, _MAX_GATHER_ELEMENTS // row_elements)
    caches = _Caches(key_cache, value_cache, key_from_value, kv_scales, blocks_per_tile)
    if query.shape[0] <= chunk:
        return _attend_rows(query, block_table, rows, caches, rule)
    output = torch.empty_like(query)
    for begin in range(0, query.shape[0], chunk):
        end = min(begin + chunk, query.shape[0])
        part = _RowPlan(*(t[begin:end] for t in rows))
        output[begin:end] = _attend_rows(query[begin:end], block_table, part, caches, rule)
    return output


class _RowPlan(NamedTuple):
    """Per query row `[R]`: its request, its position, one past its last key."""

    req: torch.Tensor
    pos: torch.Tensor
    key_end: torch.Tensor

    @classmethod
    def build(
        cls,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        key_ends: torch.Tensor | None,
        device: torch.device,
    ) -> _RowPlan:
        starts = query_start_loc.to(device).long()
        q_lens = starts[1:] - starts[:-1]
        req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=device), q_lens)
        local = torch.arange(int(starts[-1]), device=device) - starts[req]
        pos = seq_lens.to(device).long()[req] - q_lens[req] + local
        key_end = pos + 1 if key_ends is None else key_ends.to(device).long()
        return cls(req, pos, key_end)


class _Caches(NamedTuple):
    """The pages and how to read them; a tile is `blocks_per_tile` whole blocks."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    key_from_value: KeyFromValue | None
    kv_scales: KVScales | None
    blocks_per_tile: int


def _attend_rows(
    query: torch.Tensor,
    block_table: torch.Tensor,
    rows: _RowPlan,
    caches: _Caches,
    rule: ScoreRule,
) -> torch.Tensor:
    """Rows `query` `[R, num_q_heads, head_size]` over their tiles, in tile order."""
    pos, key_end = rows.pos, rows.key_end
    key_cache, blocks_per_tile = caches.key_cache, caches.blocks_per_tile
    key_start = torch.zeros_like(pos)
    if rule.sliding_window is not None:
        key_start = (pos - rule.sliding_window + 1).clamp(min=0)
    tile_keys = blocks_per_tile * key_cache.shape[1]
    first_tile = key_start // tile_keys
    num_tiles = int(((key_end - 1) // tile_keys - first_tile).max()) + 1
    num_rows, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    q = query.float().view(num_rows, num_kv_heads, group, head_size)
    state = _initial_state(num_rows, num_kv_heads, group, head_size, rule, query.device)
    for step in range(num_tiles):
        tile = first_tile + step
        keys, values, visible = _gather_tile(block_table, tile, rows, key_start, caches)
        # [R, kv, group, size] @ [R, kv, size, tile] -> [R, kv, group, tile]
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)) * rule.scale
        if rule.softcap is not None:
            scores = whole_vectors(torch.tanh, scores / rule.softcap) * rule.softcap
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        state = _fold_tile(state, scores, values)
    _, total, acc = state
    out = acc / total[..., None]
    return out.view(num_rows, num_q_heads, head_size).to(query.dtype)


def _initial_state(
    num_rows: int,
    num_kv_heads: int,
    group: int,
    head_size: int,
    rule: ScoreRule,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(running max, running sum, accumulator) before the first tile: the sink logit as a key
    of value zero, else nothing seen (max -inf)."""
    shape = (num_rows, num_kv_heads, group)
    acc = torch.zeros(*shape, head_size, device=device)
    if rule.sinks is None:
        return (
            torch.full(shape, float("-inf"), device=device),
            torch.zeros(shape, device=device),
            acc,
        )
    peak = rule.sinks.to(device).view(1, num_kv_heads, group).expand(shape).clone()
    return peak, torch.ones(shape, device=device), acc


def _fold_tile(
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scores: torch.Tensor,
    values: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One online-softmax step: scores `[R, kv, group, tile]`, values `[R, tile, kv, size]`."""
    peak, total, acc = state
    new_peak = torch.maximum(peak, scores.amax(dim=-1))
    # Nothing seen yet (-inf on both sides): the old sum and accumulator are zero anyway.
    rescale = whole_vectors(torch.exp, peak - new_peak).nan_to_num(0.0)
    safe_peak = new_peak.masked_fill(new_peak == float("-inf"), 0.0)
    probs = whole_vectors(torch.exp, scores - safe_peak[..., None])
    # [R, kv, group, tile] @ [R, kv, tile, size] -> [R, kv, group, size]
    weighted = torch.matmul(probs, values.transpose(1, 2))
    total = total * rescale + probs.sum(dim=-1)
    acc = acc * rescale[..., None] + weighted
    return new_peak, total, acc


def _gather_tile(
    block_table: torch.Tensor,
    tile: torch.Tensor,
    rows: _RowPlan,
    key_start: torch.Tensor,
    caches: _Caches,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tile `tile[r]`: fp32 keys and values `[R, tile_keys, kv, size]` and which
    keys the row sees `[R, tile_keys]` (values of the others zeroed, as stale slots may hold
    NaN and a zero weight times NaN is NaN)."""
    key_end = rows.key_end
    key_cache, value_cache, key_from_value, kv_scales, blocks_per_tile = caches
    block_size = key_cache.shape[1]
    last_block = (key_end - 1) // block_size
    logical = tile[:, None] * blocks_per_tile + torch.arange(blocks_per_tile, device=tile.device)
    logical = torch.minimum(logical, last_block[:, None])  # past the row's end: a block it owns
    block_ids = block_table.long()[rows.req[:, None], logical].flatten()
    tile_keys = blocks_per_tile * block_size
    positions = tile[:, None] * tile_keys + torch.arange(tile_keys, device=tile.device)
    visible = (positions >= key_start[:, None]) & (positions < key_end[:, None])
    key_scale, value_scale = split_scales(kv_scales)
    num_rows = rows.req.numel()

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        pages = cache.index_select(0, block_ids)  # [R * blocks, block_size, kv, size]
        return dequantize(pages.view(num_rows, -1, *cache.shape[2:]), scale)

    values = gather(value_cache, value_scale).masked_fill(~visible[:, :, None, None], 0.0)
    if key_from_value is None:
        keys = gather(key_cache, key_scale)
    else:
        flat = values.flatten(0, 1)
        keys = rotate_values_into_keys(flat, positions.flatten(), key_from_value).view_as(values)
    # Keys a row does not see are left as they are: their scores are masked to -inf (NaN too).
    return keys, values, visible

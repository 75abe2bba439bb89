"""Decode kernels over fixed-shape inputs: no host synchronisation, no data-dependent shape.

A captured decode step (a CUDA graph, or a `torch.compile(fullgraph=True)` trace) runs a batch
of `num_seqs` sequences with the same number `q` of query rows each (1 for decode, k + 1 for a
speculative verify), padded to a capture size. These kernels keep the signatures of the varlen
ones (`kernels.reference`, `kernels.mamba_reference`, `kernels.gated_delta_reference`) and read
the batch layout from the shapes alone; `query_start_loc` is ignored, cut positions are a static
list (the same offsets in every sequence).

    query rows   [ s0: q rows | s1: q rows | ... | padded sequences (never read) ]
    query row j of sequence s sits at position seq_lens[s] - q + j

Padded sequences write their KV to slot -1 (skipped by redirecting to the null block 0, which
no request reads) and their states to the null block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.gated_delta_reference import DeltaRuleInputs, DeltaRuleOutput, expand_heads
from kernels.gated_delta_registry import GatedDeltaKernels
from kernels.kv_quant import KVScales, dequantize, quantize, split_scales
from kernels.mamba_reference import ConvOutput, ScanOutput, _single_token_step, discretize_dt
from kernels.mamba_registry import MambaKernels
from kernels.reference import KeyFromValue, rotate_values_into_keys


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """`kernels.reference.store_kv_cache` with a fixed shape: slot -1 writes the null block."""
    key_scale, value_scale = split_scales(kv_scales)
    block_size = key_cache.shape[1]
    slots = slot_mapping.long().clamp(min=0)  # -1 -> slot 0 of the null block
    index = (slots // block_size, slots % block_size)
    key_cache.index_put_(index, quantize(key, key_scale, key_cache.dtype))
    value_cache.index_put_(index, quantize(value, value_scale, value_cache.dtype))


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
    """Causal attention of `q = len(query) // len(seq_lens)` rows per sequence over every block
    of its block-table row (the whole row is gathered: a fixed shape); see the reference."""
    del query_start_loc, key_ends  # uniform rows; decode rows see causally only
    num_seqs, num_blocks = block_table.shape
    num_rows, num_q_heads, head_size = query.shape
    rows_per_seq = num_rows // num_seqs
    block_size, num_kv_heads = value_cache.shape[1], value_cache.shape[2]
    group = num_q_heads // num_kv_heads
    keys, values = _gather_pages(key_cache, value_cache, block_table, key_from_value, kv_scales)
    length = num_blocks * block_size
    key_pos = torch.arange(length, device=query.device)  # [L]
    query_pos = (
        seq_lens.long()[:, None] - rows_per_seq + torch.arange(rows_per_seq, device=query.device)
    )
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [S, q, L]
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    values = values.masked_fill(~visible.any(1)[:, :, None, None], 0.0)  # stale slots: any value
    q = query.float().view(num_seqs, rows_per_seq, num_kv_heads, group, head_size)
    scores = torch.einsum("sqhgd,slhd->shgql", q, keys) * scale  # [S, kv, group, q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        sink = sinks.float().view(1, num_kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("shgql,slhd->sqhgd", probs, values)
    return out.reshape(num_rows, num_q_heads, head_size).to(query.dtype)


def _gather_pages(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    key_from_value: KeyFromValue | None,
    kv_scales: KVScales | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys and values `[S, L, kv_heads, head_size]` of every block of each row."""
    num_seqs = block_table.shape[0]
    block_ids = block_table.long().flatten()
    key_scale, value_scale = split_scales(kv_scales)

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        pages = cache.index_select(0, block_ids)
        return dequantize(pages.view(num_seqs, -1, *cache.shape[2:]), scale)

    values = gather(value_cache, value_scale)
    if key_from_value is None:
        return gather(key_cache, key_scale), values
    length = values.shape[1]
    positions = torch.arange(length, device=values.device).repeat(num_seqs)
    keys = rotate_values_into_keys(values.flatten(0, 1), positions, key_from_value)
    return keys.view(values.shape), values


def chunked_local_view(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rows_per_seq: int,
    chunk_size: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked local attention as one virtual sequence per query row, with fixed shapes: the
    row's block-table columns from its chunk's first block on, and its keys in that chunk.

    Returns (block table `[S * q, chunk_size // block_size]` int32, seq_lens `[S * q]` int32);
    a query at position p sees keys `[p // C * C, p]` (the kernel block size `block_size`
    divides C, so chunks start on block boundaries)."""
    width = block_table.shape[1]
    device = block_table.device
    steps = torch.arange(rows_per_seq, device=device)
    query_pos = (seq_lens.long()[:, None] - rows_per_seq + steps).clamp(min=0)  # [S, q]
    key_start = query_pos // chunk_size * chunk_size
    columns = key_start[..., None] // block_size + torch.arange(
        chunk_size // block_size, device=device
    )  # [S, q, C / bs]; columns past the table hold keys past the query, never read
    columns = columns.clamp(max=width - 1)
    rows = torch.arange(block_table.shape[0], device=device)[:, None, None]
    table = block_table[rows, columns].flatten(0, 1)
    return table.to(torch.int32), (query_pos - key_start + 1).flatten().to(torch.int32)


def causal_conv1d(  # noqa: PLR0913 (the signature shared by every backend)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    query_start_loc: object,
    activation: str | None = "silu",
    cut_positions: Sequence[int] = (),
) -> ConvOutput:
    """`kernels.mamba_reference.causal_conv1d` over `q` rows per sequence (see the module)."""
    del query_start_loc
    num_seqs, dim, width_1 = initial_states.shape
    rows = x.shape[0] // num_seqs
    inputs = torch.cat([initial_states.transpose(1, 2).to(x.dtype), x.view(num_seqs, rows, dim)], 1)
    out = torch.zeros(num_seqs, rows, dim, dtype=torch.float32, device=x.device)
    for k in range(weight.shape[1]):  # out[t] += weight[:, k] * in[t - width + 1 + k]
        out += inputs[:, k : k + rows].float() * weight[:, k].float()
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    final = inputs[:, rows : rows + width_1].transpose(1, 2)
    offsets = _cut_offsets(cut_positions, num_seqs, rows)
    cut = [inputs[:, off : off + width_1].transpose(1, 2) for off in offsets]
    return ConvOutput(out.view(-1, dim).to(x.dtype), final, _stack_cuts(cut, final))


def ssd_scan(  # noqa: PLR0913 (the signature shared by every backend)
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    query_start_loc: object,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    cut_positions: Sequence[int] = (),
) -> ScanOutput:
    """`kernels.mamba_reference.ssd_scan` as `q` single-token steps per sequence."""
    del query_start_loc, chunk_size
    num_seqs = initial_states.shape[0]
    rows = x.shape[0] // num_seqs
    dt = discretize_dt(dt, dt_bias, dt_limit)

    def per_step(t: torch.Tensor) -> torch.Tensor:
        return t.view(num_seqs, rows, *t.shape[1:])

    xs, dts, bs, cs = per_step(x), per_step(dt), per_step(B), per_step(C)
    state, outs, states = initial_states, [], []
    for j in range(rows):
        step = _single_token_step(xs[:, j], dts[:, j], A, bs[:, j], cs[:, j], D, state)
        state = step.final_states
        outs.append(step.out)
        states.append(state)
    out = torch.stack(outs, 1).view(x.shape)
    offsets = _cut_offsets(cut_positions, num_seqs, rows)
    return ScanOutput(out, state, _stack_cuts([states[off - 1] for off in offsets], state))


def gated_delta_rule(
    inputs: DeltaRuleInputs,
    initial_states: torch.Tensor,
    query_start_loc: object,
    scale: float,
    cut_positions: Sequence[int] = (),
) -> DeltaRuleOutput:
    """The recurrent gated delta rule (`kernels.gated_delta_reference`), `q` steps per
    sequence, for both its decode and verify forms."""
    del query_start_loc
    num_seqs = initial_states.shape[0]
    x = expand_heads(inputs)
    rows = x.v.shape[0] // num_seqs
    state = initial_states.to(x.v.dtype).clone()  # [S, H, K, V]
    outs, states = [], []
    for j in range(rows):
        q, k, v, g, beta = (t.view(num_seqs, rows, *t.shape[1:])[:, j] for t in x)
        state = state * g.exp()[:, :, None, None]
        recalled = (k[:, :, None, :] @ state).squeeze(2)  # [S, H, V]
        delta = beta[..., None] * (v - recalled)
        state = state + k[..., :, None] * delta[..., None, :]
        outs.append(((q * scale)[:, :, None, :] @ state).squeeze(2))
        states.append(state)
    out = torch.stack(outs, 1).view(x.v.shape).to(inputs.v.dtype)
    offsets = _cut_offsets(cut_positions, num_seqs, rows)
    return DeltaRuleOutput(out, state, _stack_cuts([states[off - 1] for off in offsets], state))


def _cut_offsets(cut_positions: Sequence[int], num_seqs: int, rows: int) -> list[int]:
    """The offsets (1 .. q - 1) every sequence cuts at; the positions must list them for each
    sequence in order (the static step's layout)."""
    offsets = sorted({int(p) % rows for p in cut_positions})
    expected = [seq * rows + off for seq in range(num_seqs) for off in offsets]
    if list(cut_positions) != expected or 0 in offsets:
        raise ValueError("static decode kernels need the same cut offsets in every sequence")
    return offsets


def _stack_cuts(cuts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Cut states in position order (sequence-major) `[S * len(cuts), ...]`."""
    if not cuts:
        return like.new_zeros(0, *like.shape[1:])
    return torch.stack(cuts, 1).flatten(0, 1)


STATIC_GATED_DELTA = GatedDeltaKernels("static", gated_delta_rule, gated_delta_rule)
STATIC_MAMBA = MambaKernels("static", causal_conv1d, ssd_scan, STATIC_GATED_DELTA)
"""The state kernels of a captured decode step (every state layer reads them from its
metadata)."""

"""Attention-metadata transforms: common metadata in, common metadata out.

Two transforms, applied by the metadata builder of an attention group whose layers need them:

- **truncated prefill** keeps only the query rows whose hidden states matter after the layer
  (the rows whose logits are sampled, plus every row of a request that asked for prompt
  logprobs; a prompt chunk that samples nothing keeps no row). The kept rows are the last rows
  of each request and causal masks are bottom-right aligned, so `seq_lens`, block table and
  slot mapping stay as they are.
- **chunked-local virtual batches** cut each request's query span at chunk boundaries into
  "virtual requests", each a plain causal attention over at most `chunk_size` keys, so a
  chunked-local layer runs on the ordinary paged-attention kernel.

They compose in that order (truncate, then cut). Both work on torch tensors on any device.

This module is the one home of truncated prefill: which layers it applies to (the trailing run
of KV-sharing layers, `truncated_prefill_layers`; the decoder layer that run starts at,
`first_truncated_layer`), the rows it keeps and its metadata transform. Attention groups and the
decoder loop (`decoder_loop.py`) only call these.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from worker.attention.attention import AttentionMetadata


class VirtualBatches(NamedTuple):
    """Metadata of the virtual requests of a chunked-local layer (slot mapping unchanged)."""

    query_start_loc: torch.Tensor  # [num_virtual + 1] int32
    seq_lens: torch.Tensor  # [num_virtual] int32: keys of each virtual request
    block_table: torch.Tensor  # [num_virtual, chunk_size // block_size] int32
    key_starts: torch.Tensor  # [num_virtual] int64: absolute position of the first key
    req_indices: torch.Tensor  # [num_virtual] int64: the real request of each virtual one
    max_query_len: int
    max_seq_len: int


class TruncatedRows(NamedTuple):
    """Query layout after truncated prefill; `query_rows` None means every row is kept."""

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    max_query_len: int
    num_actual_tokens: int
    query_rows: torch.Tensor | None  # [num_kept] int64, ascending


def make_virtual_batches(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    chunk_size: int,
    block_size: int,
) -> VirtualBatches:
    """Cut every request into virtual requests that never cross a multiple of `chunk_size`.

    A query at position p attends keys in `[floor(p / C) * C, p]`. With query length q, total
    length k and `last = (k - 1) % C + 1` keys in the final chunk, a request becomes
    `1 + cdiv(q - q_first, C)` virtual requests, where `q_first = min(C - (k - q) % C, q)`
    tokens finish the chunk the context ends in. Virtual j (r = nv - 1 - j counted from the
    end) has keys `[k - r*C - last, ...)`: C of them, except `last` for the final one.
    `block_size` is the block table's (kernel) block size and must divide `chunk_size`.
    A request with no query rows (dropped by truncated prefill) becomes one empty virtual request.
    """
    check_chunk_size(chunk_size, block_size)
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    total_lens = seq_lens.long()
    assert bool((total_lens >= 1).all()), "every request must hold at least one token"
    req_indices, virtual_q, virtual_k, key_starts = _virtual_spans(
        query_lens, total_lens, chunk_size
    )
    columns = key_starts[:, None] // block_size + torch.arange(
        chunk_size // block_size, device=key_starts.device
    )
    # Columns past the table only hold keys past seq_len, which are never read.
    columns = columns.clamp(max=block_table.shape[1] - 1)
    virtual_table = block_table[req_indices[:, None], columns]
    qsl = torch.zeros(len(virtual_q) + 1, dtype=torch.int32, device=key_starts.device)
    qsl[1:] = torch.cumsum(virtual_q, 0)
    return VirtualBatches(
        query_start_loc=qsl,
        seq_lens=virtual_k.to(torch.int32),
        block_table=virtual_table.to(torch.int32),
        key_starts=key_starts,
        req_indices=req_indices,
        max_query_len=int(virtual_q.max()) if len(virtual_q) else 0,
        max_seq_len=int(virtual_k.max()) if len(virtual_k) else 0,
    )


def _virtual_spans(
    query_lens: torch.Tensor, total_lens: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per virtual request: its real request, query length, key length, first key position."""
    first_lens = torch.minimum(chunk_size - (total_lens - query_lens) % chunk_size, query_lens)
    last_lens = (total_lens - 1) % chunk_size + 1
    num_virtual = 1 + _cdiv(query_lens - first_lens, chunk_size)
    req_indices = torch.repeat_interleave(
        torch.arange(len(num_virtual), device=query_lens.device), num_virtual
    )
    first_virtual = torch.cumsum(num_virtual, 0) - num_virtual
    index = torch.arange(len(req_indices), device=query_lens.device) - first_virtual[req_indices]
    from_end = num_virtual[req_indices] - 1 - index
    later_lens = query_lens[req_indices] - first_lens[req_indices] - chunk_size * (index - 1)
    virtual_q = torch.where(
        index == 0, first_lens[req_indices], torch.clamp(later_lens, max=chunk_size)
    )
    virtual_k = torch.where(
        from_end == 0, last_lens[req_indices], torch.full_like(from_end, chunk_size)
    )
    key_starts = total_lens[req_indices] - (from_end * chunk_size + last_lens[req_indices])
    return req_indices, virtual_q, virtual_k, key_starts


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """Virtual requests start at chunk boundaries, which must be block boundaries."""
    if chunk_size < 1 or chunk_size % block_size:
        raise ValueError(
            f"attention chunk size {chunk_size} is not a multiple of the KV cache block size "
            f"{block_size} used by the attention kernel; choose a block_size that divides "
            f"{chunk_size}"
        )


def truncate_prefill(
    query_start_loc: torch.Tensor,
    logits_indices: torch.Tensor,
    full_reqs: torch.Tensor | None = None,
) -> TruncatedRows:
    """Keep only the rows in `logits_indices`, plus every row of the requests in `full_reqs`.

    Pure decode (one row per request) passes through unchanged. Each request's kept rows must be
    its last rows (they are: sampled rows end a request's span), which this asserts. A request
    with no kept row (a prompt chunk that samples nothing) keeps its place with query length 0.
    """
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    num_tokens = int(query_start_loc[-1])
    max_query_len = int(query_lens.max()) if len(query_lens) else 0
    if max_query_len <= 1:
        return TruncatedRows(query_start_loc, max_query_len, num_tokens, None)
    keep = torch.zeros(num_tokens, dtype=torch.bool, device=query_start_loc.device)
    keep[logits_indices.long()] = True
    if full_reqs is not None and len(full_reqs):
        owner = torch.repeat_interleave(
            torch.arange(len(query_lens), device=keep.device), query_lens.long()
        )
        keep |= torch.isin(owner, full_reqs.to(owner.device))
    rows = torch.nonzero(keep).flatten()
    owner_of_row = torch.bucketize(rows, query_start_loc[1:].long(), right=True)
    counts = torch.bincount(owner_of_row, minlength=len(query_lens))
    _assert_suffix_rows(rows, owner_of_row, counts, query_start_loc)
    new_qsl = torch.zeros_like(query_start_loc)
    new_qsl[1:] = torch.cumsum(counts, 0)
    return TruncatedRows(new_qsl, int(counts.max()), len(rows), rows)


def _assert_suffix_rows(
    rows: torch.Tensor, owner: torch.Tensor, counts: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    """The kept rows of each request are its last `count` rows, in order."""
    first_kept = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(rows), device=rows.device) - first_kept[owner]
    expected = query_start_loc[1:].long()[owner] - counts[owner] + rank
    assert torch.equal(rows, expected), "kept rows are not a suffix of each request's rows"


def _cdiv(numer: torch.Tensor, denom: int) -> torch.Tensor:
    return -(-numer // denom)


def truncated_prefill_layers(names: Sequence[str], sharing: Collection[str]) -> tuple[str, ...]:
    """The trailing run of `names` (attention layers in model order) that read another layer's
    KV (`sharing`), last layer first: the layers truncated prefill runs on the kept rows."""
    eligible: list[str] = []
    for name in reversed(names):
        if name not in sharing:
            break
        eligible.append(name)
    return tuple(eligible)


def first_truncated_layer(per_layer: Sequence[Sequence[str]], sharing: Collection[str]) -> int:
    """Index of the first decoder layer of the truncated run; `per_layer` holds the attention
    layer names of each decoder layer in model order. ValueError when a decoder layer of the
    run also holds a layer that owns KV or none has attention (it cannot run on fewer rows)."""
    names = [name for names in per_layer for name in names]
    eligible = set(truncated_prefill_layers(names, sharing))
    first = len(per_layer)
    while first > 0 and per_layer[first - 1]:
        if not all(name in eligible for name in per_layer[first - 1]):
            break
        first -= 1
    covered = {name for names in per_layer[first:] for name in names}
    if covered != eligible:
        raise ValueError(
            f"KV-sharing layers {sorted(eligible - covered)} end the model's attention layers, "
            "but a decoder layer from theirs on also holds a layer that owns KV or has no "
            "attention, so truncated prefill cannot run them on fewer rows; give the trailing "
            "sharing layers decoder layers of their own"
        )
    return first


@dataclass(frozen=True)
class StepRows:
    """Per-step facts the transforms need beyond the metadata itself."""

    logits_indices: torch.Tensor
    """[num_logits] int64: rows whose hidden states reach the LM head."""
    full_reqs: torch.Tensor | None = None
    """Requests whose every row must be computed (they asked for prompt logprobs)."""


@dataclass(frozen=True)
class TruncatedPrefill:
    """Transform: compute only the rows that reach the LM head (trailing KV-sharing layers)."""

    def __call__(self, meta: AttentionMetadata, step: StepRows) -> AttentionMetadata:
        assert meta.query_rows is None, "truncated prefill applies to untruncated metadata"
        kept = truncate_prefill(meta.query_start_loc, step.logits_indices, step.full_reqs)
        if kept.query_rows is None:
            return meta
        return replace(
            meta,
            query_start_loc=kept.query_start_loc,
            max_query_len=kept.max_query_len,
            num_actual_tokens=kept.num_actual_tokens,
            query_rows=kept.query_rows,
            key_ends=None if meta.key_ends is None else meta.key_ends[kept.query_rows],
        )


@dataclass(frozen=True)
class ChunkedLocalBatches:
    """Transform: chunked local attention as virtual requests of at most `chunk_size` keys."""

    chunk_size: int
    block_size: int
    """Block size of the block table in the metadata (the kernel block size)."""

    def __post_init__(self) -> None:
        check_chunk_size(self.chunk_size, self.block_size)

    def __call__(self, meta: AttentionMetadata, step: StepRows) -> AttentionMetadata:
        assert meta.key_ends is None, "chunked local layers attend causally (no image spans)"
        virtual = make_virtual_batches(
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            self.chunk_size,
            self.block_size,
        )
        return replace(
            meta,
            query_start_loc=virtual.query_start_loc,
            seq_lens=virtual.seq_lens,
            block_table=virtual.block_table,
            max_query_len=virtual.max_query_len,
            max_seq_len=virtual.max_seq_len,
        )


MetadataTransform = TruncatedPrefill | ChunkedLocalBatches


def apply_transforms(
    meta: AttentionMetadata, transforms: tuple[MetadataTransform, ...], step: StepRows
) -> AttentionMetadata:
    """Apply `transforms` in order (truncated prefill must come before virtual batches)."""
    for transform in transforms:
        meta = transform(meta, step)
    return meta

"""Builders of paged-attention inputs and a naive dense oracle, for tests and benchmarks.

`make_paged_batch` scatters dense per-request K/V into randomly placed cache blocks, fills
every unused slot with NaN and points stale block-table entries at a NaN "poison" block, so
a kernel that reads anything it should not produces NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference import KeyFromValue


@dataclass(frozen=True)
class BatchSpec:
    """Shape of a test batch: one `(q_len, seq_len)` pair per request, plus head layout."""

    requests: tuple[tuple[int, int], ...]
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    block_size: int = 4
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    """Blocks wholly outside this window get stale block-table entries."""
    stale_block_id: int | None = None
    """Block id written into stale entries; None means the NaN-filled poison block."""
    is_interleaved: bool = False
    """K and V pages alternate in one raw buffer, so both caches are strided views."""


@dataclass(frozen=True)
class PagedBatch:
    """Kernel inputs built from a `BatchSpec`, plus the dense K/V they were built from."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    keys: tuple[torch.Tensor, ...]  # per request [seq_len, num_kv_heads, head_size]
    values: tuple[torch.Tensor, ...]

    def kernel_args(self, scale: float) -> tuple[object, ...]:
        """The positional arguments every backend's `paged_attention` takes."""
        tensors = (self.query, self.key_cache, self.value_cache, self.block_table)
        return (*tensors, self.query_start_loc, self.seq_lens, scale)


def allocate_caches(
    num_blocks: int, spec: BatchSpec, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-filled key and value caches, as views into one raw buffer."""
    page = (spec.block_size, spec.num_kv_heads, spec.head_size)
    if spec.is_interleaved:
        raw = torch.full((num_blocks, 2, *page), float("nan"), dtype=spec.dtype, device=device)
        return raw[:, 0], raw[:, 1]
    raw = torch.full((2, num_blocks, *page), float("nan"), dtype=spec.dtype, device=device)
    return raw[0], raw[1]


def make_paged_batch(
    spec: BatchSpec, seed: int = 0, device: torch.device | str = "cpu"
) -> PagedBatch:
    """Random query and K/V for `spec`, with K/V scattered into a paged cache."""
    gen = torch.Generator().manual_seed(seed)
    block_size = spec.block_size
    blocks_per_req = [-(-seq_len // block_size) for _, seq_len in spec.requests]
    num_blocks = sum(blocks_per_req) + 2  # one spare, one poison block (the last)
    poison = num_blocks - 1
    stale = poison if spec.stale_block_id is None else spec.stale_block_id
    key_cache, value_cache = allocate_caches(num_blocks, spec, device)
    order = torch.randperm(num_blocks - 1, generator=gen)
    block_table = torch.full((len(spec.requests), max(blocks_per_req, default=0) + 1), stale)
    keys, values = [], []
    for req_idx, (q_len, seq_len) in enumerate(spec.requests):
        ids = order[sum(blocks_per_req[:req_idx]) :][: blocks_per_req[req_idx]]
        key, value = (_randn((seq_len, *key_cache.shape[2:]), spec.dtype, gen) for _ in range(2))
        slots = ids.repeat_interleave(block_size)[:seq_len] * block_size
        slots += torch.arange(seq_len) % block_size
        key_cache[slots // block_size, slots % block_size] = key.to(device)
        value_cache[slots // block_size, slots % block_size] = value.to(device)
        first_live = _first_live_block(seq_len - q_len, spec.sliding_window, block_size)
        block_table[req_idx, first_live : len(ids)] = ids[first_live:]
        keys.append(key.to(device))
        values.append(value.to(device))
    lens = torch.tensor(spec.requests, dtype=torch.int32).reshape(-1, 2)
    query_shape = (int(lens[:, 0].sum()), spec.num_q_heads, spec.head_size)
    return PagedBatch(
        query=_randn(query_shape, spec.dtype, gen).to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(torch.int32).to(device),
        query_start_loc=torch.nn.functional.pad(lens[:, 0].cumsum(0), (1, 0)).int().to(device),
        seq_lens=lens[:, 1].contiguous().to(device),
        keys=tuple(keys),
        values=tuple(values),
    )


def dense_attention(
    batch: PagedBatch,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    key_from_value: KeyFromValue | None = None,
) -> torch.Tensor:
    """Naive float64 attention over the unpaged K/V, one request at a time; `sinks`
    [num_q_heads] add exp(sink) to each head's softmax denominator; `key_from_value`: the keys
    are rebuilt from the values (`dense_keys_from_values`)."""
    starts = batch.query_start_loc.tolist()
    outputs = []
    for req_idx, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        if key_from_value is not None:
            key = dense_keys_from_values(value, key_from_value)
        query = batch.query[starts[req_idx] : starts[req_idx + 1]].double()
        group = query.shape[1] // key.shape[1]
        key = key.double().repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_size]
        value = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, key) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        query_pos = torch.arange(key.shape[0] - query.shape[0], key.shape[0])[:, None]
        key_pos = torch.arange(key.shape[0])[None, :]
        allowed = key_pos <= query_pos
        if sliding_window is not None:
            allowed &= query_pos - key_pos < sliding_window
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        weights = scores.exp()
        denominator = weights.sum(-1, keepdim=True)
        if sinks is not None:
            denominator = denominator + sinks.double().exp().to(scores.device)[:, None, None]
        outputs.append(torch.einsum("hqk,khd->qhd", weights / denominator, value))
    if not outputs:
        return batch.query.double()
    return torch.cat(outputs)


def dense_keys_from_values(value: torch.Tensor, key_from_value: KeyFromValue) -> torch.Tensor:
    """float64 keys of one request's values `[seq_len, heads, D]` at positions 0, 1, ...:
    rope (pairs d, d + R/2 of the first R features) of `value * scale`."""
    scaled = value.double() * key_from_value.scale.double().to(value.device)
    half = key_from_value.inv_freq.numel()
    angles = torch.arange(value.shape[0]).double()[:, None] * key_from_value.inv_freq.double()
    cos = (angles.cos() * key_from_value.attention_scaling)[:, None, :].to(value.device)
    sin = (angles.sin() * key_from_value.attention_scaling)[:, None, :].to(value.device)
    first, second = scaled[..., :half], scaled[..., half : 2 * half]
    return torch.cat(
        (first * cos - second * sin, second * cos + first * sin, scaled[..., 2 * half :]), dim=-1
    )


def make_key_from_value(
    head_size: int, rotary_dim: int, num_zero_freqs: int = 0, seed: int = 0
) -> KeyFromValue:
    """A random per-feature scale and rope frequencies over `rotary_dim` features, the last
    `num_zero_freqs` pairs unrotated (Gemma 4's proportional rope), cos/sin scaled by 1.25."""
    gen = torch.Generator().manual_seed(seed)
    scale = 1.0 + 0.3 * torch.randn(head_size, generator=gen)
    inv_freq = 1.0 / (100.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    if num_zero_freqs:
        inv_freq[-num_zero_freqs:] = 0.0
    return KeyFromValue(scale, inv_freq, 1.25)


def _first_live_block(context_len: int, sliding_window: int | None, block_size: int) -> int:
    """First block that a query of this request can see; earlier ones are stale."""
    if sliding_window is None:
        return 0
    return max(0, context_len - sliding_window + 1) // block_size


def _randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)

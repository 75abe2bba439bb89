"""Plain-PyTorch Mamba-2 kernels over varlen batches: the CPU serving path and the test oracle.

A step's tokens are flat (`[num_tokens, ...]`) and `query_start_loc` cuts them into sequences
(prefill chunks and single-token decodes mixed). Each sequence starts from an initial state
(zeros for a fresh request) and ends with a final state; `cut_positions` (global token
indices p, each strictly inside a sequence) ask for the state after the tokens before p as
well (states at block boundaries inside a prefill chunk).

    tokens   |-- seq 0 (prefill chunk) --|- seq 1 -|s2|
    chunks   |  c0  |  c1 ^cut |  c2  |c3|   c4    |c5|     (cut ends a chunk)

The SSD scan is the chunked ("state space duality") form: quadratic attention-like products
inside chunks of at most `chunk_size` tokens, a linear recurrence over chunk states between
them. Chunks are cut at sequence starts, every `chunk_size` tokens, and at `cut_positions`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F


class ConvOutput(NamedTuple):
    """Output of `causal_conv1d`: activations and the conv states the step leaves."""

    out: torch.Tensor  # [num_tokens, dim]
    final_states: torch.Tensor  # [num_seqs, dim, width - 1]
    cut_states: torch.Tensor  # [num_cuts, dim, width - 1]


class ScanOutput(NamedTuple):
    """Output of `ssd_scan`: y and the fp32 SSM states the step leaves."""

    out: torch.Tensor  # [num_tokens, heads, head_dim]
    final_states: torch.Tensor  # [num_seqs, heads, head_dim, state_size]
    cut_states: torch.Tensor  # [num_cuts, heads, head_dim, state_size]


def as_host_list(values: torch.Tensor | Sequence[int]) -> list[int]:
    """Integer boundaries on the host (a tensor is copied once)."""
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


def seq_of_positions(starts: list[int], positions: list[int]) -> list[int]:
    """Index of the sequence holding each global position (starts = query_start_loc)."""
    out, seq = [], 0
    for pos in positions:
        while starts[seq + 1] <= pos:
            seq += 1
        if not starts[seq] < pos < starts[seq + 1]:
            raise ValueError(f"cut position {pos} is not strictly inside a sequence")
        out.append(seq)
    return out


class _ConvSource(NamedTuple):
    """All conv inputs of a step in one tensor: every sequence's state rows, then the tokens."""

    rows: torch.Tensor  # [num_seqs * (width - 1) + num_tokens, dim]
    starts: torch.Tensor  # [num_seqs] int64, query_start_loc on the device
    width_1: int

    def row_index(self, seqs: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Row of position `local` of each sequence in [state (width - 1) | its tokens]."""
        num_state_rows = self.starts.numel() * self.width_1
        from_state = seqs * self.width_1 + local
        from_tokens = num_state_rows + self.starts[seqs] + local - self.width_1
        return torch.where(local < self.width_1, from_state, from_tokens)

    def states(self, seqs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """The width - 1 inputs before local token `ends` of `seqs`: `[n, dim, width - 1]`."""
        cols = torch.arange(self.width_1, device=ends.device)
        index = self.row_index(seqs[:, None], ends[:, None] + cols[None, :])
        return self.rows[index].transpose(1, 2)


def _conv_source(x: torch.Tensor, initial_states: torch.Tensor, starts: list[int]) -> _ConvSource:
    width_1 = initial_states.shape[-1]
    state_rows = initial_states.transpose(1, 2).reshape(-1, x.shape[1]).to(x.dtype)
    starts_t = torch.tensor(starts[:-1], dtype=torch.int64, device=x.device)
    return _ConvSource(torch.cat([state_rows, x]), starts_t, width_1)


def _token_seqs(starts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence and local position of every token."""
    lengths = torch.tensor([starts[i + 1] - starts[i] for i in range(len(starts) - 1)])
    seqs = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    local = torch.arange(starts[-1]) - torch.tensor(starts[:-1], dtype=torch.int64)[seqs]
    return seqs.to(device), local.to(device)


def collect_conv_states(
    x: torch.Tensor,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    cut_positions: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final and cut conv states of a step (a gather; shared by every conv backend)."""
    starts = as_host_list(query_start_loc)
    source = _conv_source(x, initial_states, starts)
    num_seqs = len(starts) - 1
    lengths = torch.tensor([starts[i + 1] - starts[i] for i in range(num_seqs)], device=x.device)
    final = source.states(torch.arange(num_seqs, device=x.device), lengths)
    cut_seqs = seq_of_positions(starts, list(cut_positions))
    cut_ends = [pos - starts[s] for pos, s in zip(cut_positions, cut_seqs, strict=True)]
    cut = source.states(
        torch.tensor(cut_seqs, dtype=torch.int64, device=x.device),
        torch.tensor(cut_ends, dtype=torch.int64, device=x.device),
    )
    return final, cut


def causal_conv1d(  # noqa: PLR0913 (the signature shared by every backend)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    activation: str | None = "silu",
    cut_positions: Sequence[int] = (),
    silu: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> ConvOutput:
    """Depthwise causal conv1d of each sequence, continuing from its conv state (`silu`: the
    activation's function, the batch-invariant mode's on whole vectors).

    Args:
        x: `[num_tokens, dim]`.
        weight: `[dim, width]`; out[t] = sum_k weight[:, k] * in[t - width + 1 + k] (+ bias).
        initial_states: `[num_seqs, dim, width - 1]`, the inputs before each sequence.
        activation: "silu" or None.
    """
    starts = as_host_list(query_start_loc)
    source = _conv_source(x, initial_states, starts)
    seqs, local = _token_seqs(starts, x.device)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(weight.shape[1]):  # out[t] += weight[:, k] * in[t - width + 1 + k]
        out += source.rows[source.row_index(seqs, local + k)].float() * weight[:, k].float()
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    final, cut = collect_conv_states(x, initial_states, starts, cut_positions)
    return ConvOutput(out.to(x.dtype), final, cut)


class _Chunks(NamedTuple):
    token_index: torch.Tensor  # [num_chunks, max_len] token index (0 where padded)
    valid: torch.Tensor  # [num_chunks, max_len] bool
    seq: list[int]
    ordinal: list[int]  # chunk number inside its sequence
    ends: list[int]  # global end position of each chunk


def _plan_chunks(starts: list[int], chunk_size: int, cuts: Sequence[int]) -> _Chunks:
    cut_set = set(cuts)
    bounds: list[tuple[int, int, int, int]] = []
    for seq in range(len(starts) - 1):
        start, end = starts[seq], starts[seq + 1]
        marks = sorted({*range(start, end, chunk_size), *(c for c in cut_set if start < c < end)})
        for ordinal, (lo, hi) in enumerate(zip(marks, [*marks[1:], end], strict=True)):
            bounds.append((lo, hi, seq, ordinal))
    max_len = max((hi - lo for lo, hi, _, _ in bounds), default=1)
    offsets = torch.arange(max_len)
    lows = torch.tensor([lo for lo, _, _, _ in bounds], dtype=torch.int64)
    lens = torch.tensor([hi - lo for lo, hi, _, _ in bounds], dtype=torch.int64)
    valid = offsets[None, :] < lens[:, None]
    index = torch.where(valid, lows[:, None] + offsets[None, :], 0)
    return _Chunks(
        index, valid, [b[2] for b in bounds], [b[3] for b in bounds], [b[1] for b in bounds]
    )


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """softplus(dt + dt_bias), clamped to `dt_limit`, in fp32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt).clamp(min=dt_limit[0], max=dt_limit[1])


def ssd_scan(  # noqa: PLR0913 (the signature shared by every backend)
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    cut_positions: Sequence[int] = (),
) -> ScanOutput:
    """Mamba-2 selective scan: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t.

    Args:
        x: `[T, heads, head_dim]`; dt: `[T, heads]` before softplus; A: `[heads]` (negative).
        B, C: `[T, groups, state]` (heads split evenly over groups); D, dt_bias: `[heads]`.
        initial_states: `[num_seqs, heads, head_dim, state]`.
    """
    starts = as_host_list(query_start_loc)
    seq_of_positions(starts, list(cut_positions))  # validates the cuts
    lengths = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
    dt = discretize_dt(dt, dt_bias, dt_limit)  # [T, H]
    singles = [i for i, n in enumerate(lengths) if n == 1]
    if len(singles) == len(lengths):
        return _single_token_step(x, dt, A, B, C, D, initial_states)
    if not singles:
        return _chunked_scan(x, dt, A, B, C, D, initial_states, starts, chunk_size, cut_positions)
    # Mixed: decodes by the one-step formula, the longer sequences chunked; merge.
    others = [i for i, n in enumerate(lengths) if n != 1]
    single_rows = torch.tensor([starts[i] for i in singles], device=x.device)
    other_rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in others]).to(x.device)
    other_starts = [0]
    for i in others:
        other_starts.append(other_starts[-1] + lengths[i])
    local = {
        starts[i] + k: other_starts[j] + k for j, i in enumerate(others) for k in range(lengths[i])
    }
    step = _single_token_step(
        x[single_rows], dt[single_rows], A, B[single_rows], C[single_rows], D,
        initial_states[singles],
    )  # fmt: skip
    scan = _chunked_scan(
        x[other_rows], dt[other_rows], A, B[other_rows], C[other_rows], D,
        initial_states[others], other_starts, chunk_size, [local[p] for p in cut_positions],
    )  # fmt: skip
    out = torch.empty_like(x)
    out[single_rows], out[other_rows] = step.out, scan.out
    final = torch.empty(len(lengths), *step.final_states.shape[1:], device=x.device)
    final[singles], final[others] = step.final_states, scan.final_states
    return ScanOutput(out, final, scan.cut_states)


def _single_token_step(  # noqa: PLR0913
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_states: torch.Tensor,
) -> ScanOutput:
    """One token per sequence (decodes): h = exp(dt A) h0 + dt x B^T, y = h C + D x."""
    per_group = x.shape[1] // B.shape[1]
    b = B.float().repeat_interleave(per_group, dim=1)  # [S, H, N]
    c = C.float().repeat_interleave(per_group, dim=1)
    xf = x.float()
    state = initial_states.float() * torch.exp(dt * A.float())[:, :, None, None]
    state = state + (dt[:, :, None] * xf)[..., None] * b[:, :, None, :]
    y = torch.einsum("shpn,shn->shp", state, c)
    if D is not None:
        y = y + xf * D.float()[None, :, None]
    return ScanOutput(y.to(x.dtype), state, state.new_zeros(0, *state.shape[1:]))


def _chunked_scan(  # noqa: PLR0913
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    initial_states: torch.Tensor,
    starts: list[int],
    chunk_size: int,
    cut_positions: Sequence[int],
) -> ScanOutput:
    """The chunked (SSD) form over sequences of any length; `dt` already discretized."""
    num_heads = x.shape[1]
    heads_per_group = num_heads // B.shape[1]
    chunks = _plan_chunks(starts, chunk_size, cut_positions)
    valid = chunks.valid.to(x.device)
    index = chunks.token_index.to(x.device)
    dtc = dt[index] * valid[..., None]  # [c, l, h]; padding: no step
    xc = x.float()[index] * valid[..., None, None]  # [c, l, h, p]
    bc = B.float()[index].repeat_interleave(heads_per_group, dim=2)  # [c, l, h, n]
    cc = C.float()[index].repeat_interleave(heads_per_group, dim=2)
    a_cum = torch.cumsum(dtc * A.float(), dim=1)  # [c, l, h]
    diff = a_cum[:, :, None, :] - a_cum[:, None, :, :]  # [c, l, s, h]
    causal = torch.tril(torch.ones(diff.shape[1], diff.shape[2], dtype=torch.bool, device=x.device))
    decay = torch.exp(torch.where(causal[None, :, :, None], diff, float("-inf")))
    scores = torch.einsum("clhn,cshn->clsh", cc, bc) * decay
    xdt = xc * dtc[..., None]
    y = torch.einsum("clsh,cshp->clhp", scores, xdt)
    to_end = torch.exp(a_cum[:, -1:, :] - a_cum)  # [c, l, h]
    chunk_states = torch.einsum("clhn,clh,clhp->chpn", bc, to_end, xdt)
    start_states, end_states = _chunk_recurrence(
        chunk_states, torch.exp(a_cum[:, -1, :]), initial_states.float(), chunks
    )
    y = y + torch.einsum("clhn,chpn->clhp", cc, start_states) * torch.exp(a_cum)[..., None]
    if D is not None:
        y = y + xc * D.float()[None, None, :, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out[index[valid]] = y[valid]
    last = {chunks.seq[i]: i for i in range(len(chunks.seq))}
    final = end_states[[last[s] for s in range(len(starts) - 1)]]
    end_index = {end: i for i, end in enumerate(chunks.ends)}
    cut = end_states[[end_index[p] for p in cut_positions]]
    return ScanOutput(out.to(x.dtype), final, cut)


def _chunk_recurrence(
    chunk_states: torch.Tensor,
    chunk_decay: torch.Tensor,
    initial_states: torch.Tensor,
    chunks: _Chunks,
) -> tuple[torch.Tensor, torch.Tensor]:
    """State entering and leaving every chunk, one pass per chunk ordinal (batched over
    sequences): start = initial (first chunk) or the previous chunk's end state."""
    start_states = torch.empty_like(chunk_states)
    end_states = torch.empty_like(chunk_states)
    ordinals = torch.tensor(chunks.ordinal)
    seqs = torch.tensor(chunks.seq)
    for ordinal in range(int(ordinals.max()) + 1 if len(chunks.seq) else 0):
        ids = (ordinals == ordinal).nonzero().flatten()
        start = initial_states[seqs[ids]] if ordinal == 0 else end_states[ids - 1]
        dev_ids = ids.to(chunk_states.device)
        start_states[dev_ids] = start
        end_states[dev_ids] = start * chunk_decay[dev_ids][:, :, None, None] + chunk_states[dev_ids]
    return start_states, end_states

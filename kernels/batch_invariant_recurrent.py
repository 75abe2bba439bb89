"""Batch-invariant Mamba-2 scan and gated delta rule: one token at a time, for every sequence.

A chunked scan groups tokens by where the step cut the sequence (a prefill chunk, a prefix
hit, a decode, a verified draft), so a token's arithmetic changes with the cut. Here each token
updates its sequence's state with the decode formula, all sequences of a step together, and
every product is an elementwise multiply and a fixed-length sum (a batched GEMM may change its
algorithm with the batch count): a token's output and the states after it are the same whatever
the cuts, the batch, or whether the state came from the prefix cache.

    step t: sequences with more than t tokens (rows starts[s] + t)
      Mamba-2:     h = exp(dt A) h + dt x B^T             y = h C + D x
      delta rule:  S = exp(g) S ; S += k (beta (v - S^T k))^T   o = S^T (scale q)

The conv1d before both is already per token (the reference's, a fixed sum over the kernel
width, its SiLU on whole vectors: `causal_conv1d`); exponentials and softplus run on whole
vectors too (`kernels.batch_invariant.whole_vectors`), independent of the tensor sizes.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from kernels.batch_invariant import whole_vectors
from kernels.gated_delta_reference import (
    DeltaRuleInputs,
    DeltaRuleOutput,
    compute_dtype,
    expand_heads,
)
from kernels.gated_delta_registry import GatedDeltaKernels
from kernels.mamba_reference import (
    ConvOutput,
    ScanOutput,
    as_host_list,
    seq_of_positions,
)
from kernels.mamba_reference import causal_conv1d as reference_conv1d


@functools.cache
def gated_delta_kernels() -> GatedDeltaKernels:
    """The token-by-token delta rule for prefills and decodes alike."""
    return GatedDeltaKernels("batch_invariant", gated_delta_rule, gated_delta_rule)


Index = slice | list[int]
"""Rows or sequences of one step: a slice when they are consecutive."""


def _as_index(values: list[int]) -> Index:
    if values and values[-1] - values[0] == len(values) - 1:
        return slice(values[0], values[-1] + 1)
    return values


class _Steps:
    """The token loop of a step: per step t, which sequences still have a token and its row;
    collects the state after the token before each cut position."""

    def __init__(self, query_start_loc: torch.Tensor | Sequence[int], cuts: Sequence[int]):
        self.starts = as_host_list(query_start_loc)
        seq_of_positions(self.starts, list(cuts))  # validates the cuts
        self.lengths = [b - a for a, b in itertools.pairwise(self.starts)]
        self.cuts = [int(pos) for pos in cuts]
        self._cut_after = {pos - 1 for pos in self.cuts}
        self._cut_states: dict[int, torch.Tensor] = {}

    def __iter__(self) -> Iterator[tuple[Index, Index]]:
        """Per step: the sequences and the rows of their tokens (slices where contiguous, so
        a decode step gathers nothing; the values are the same either way)."""
        for step in range(max(self.lengths, default=0)):
            seqs = [s for s, n in enumerate(self.lengths) if n > step]
            rows = [self.starts[s] + step for s in seqs]
            yield _as_index(seqs), _as_index(rows)

    def keep_cuts(self, rows: Index, states: torch.Tensor) -> None:
        """Remember the states `[len(rows), ...]` left by tokens just before a cut."""
        if not self._cut_after:
            return
        row_list = range(rows.start, rows.stop) if isinstance(rows, slice) else rows
        for idx, row in enumerate(row_list):
            if row in self._cut_after:
                self._cut_states[row + 1] = states[idx]

    def cut_states(self, like: torch.Tensor) -> torch.Tensor:
        if not self.cuts:
            return like.new_zeros(0, *like.shape[1:])
        return torch.stack([self._cut_states[pos] for pos in self.cuts])


def causal_conv1d(  # noqa: PLR0913 (the signature shared by every backend)
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    activation: str | None = "silu",
    cut_positions: Sequence[int] = (),
) -> ConvOutput:
    """The reference conv (a fixed sum per token) with its SiLU on whole vectors."""
    return reference_conv1d(
        x, weight, bias, initial_states, query_start_loc, activation, cut_positions, _silu
    )


def _silu(x: torch.Tensor) -> torch.Tensor:
    return whole_vectors(F.silu, x)


def _discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """`kernels.mamba_reference.discretize_dt` with its softplus on whole vectors."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return whole_vectors(F.softplus, dt).clamp(min=dt_limit[0], max=dt_limit[1])


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
    """Mamba-2 selective scan token by token (`chunk_size` unused); see
    `kernels.mamba_reference.ssd_scan` for the arguments."""
    del chunk_size
    steps = _Steps(query_start_loc, cut_positions)
    dt = _discretize_dt(dt, dt_bias, dt_limit)  # [T, H]
    per_group = x.shape[1] // B.shape[1]
    b = B.float().repeat_interleave(per_group, dim=1)  # [T, H, N]
    c = C.float().repeat_interleave(per_group, dim=1)
    xf, decay = x.float(), whole_vectors(torch.exp, dt * A.float())  # [T, H, P], [T, H]
    states = initial_states.float().clone()  # [S, H, P, N]
    out = torch.empty(xf.shape, device=x.device)
    # Elementwise products and fixed-length sums only.
    decay, dtx = decay[:, :, None, None], dt[:, :, None] * xf  # [T, H, 1, 1], [T, H, P]
    b, c = b[:, :, None, :], c[:, :, None, :]  # [T, H, 1, N]
    for seqs, rows in steps:
        state = states[seqs] * decay[rows] + dtx[rows][..., None] * b[rows]
        out[rows] = (state * c[rows]).sum(-1)
        states[seqs] = state
        steps.keep_cuts(rows, state)
    if D is not None:
        out = out + xf * D.float()[None, :, None]
    return ScanOutput(out.to(x.dtype), states, steps.cut_states(states))


def gated_delta_rule(
    inputs: DeltaRuleInputs,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    scale: float,
    cut_positions: Sequence[int] = (),
) -> DeltaRuleOutput:
    """The gated delta rule token by token; see `kernels.gated_delta_reference`."""
    steps = _Steps(query_start_loc, cut_positions)
    q, k, v, g, beta = expand_heads(inputs)  # [T, H, K] x2, [T, H, V], [T, H] x2
    states = initial_states.to(compute_dtype(inputs.v)).clone()  # [S, H, K, V]
    decay = whole_vectors(torch.exp, g)
    out = torch.empty_like(v)
    # Elementwise products and fixed-length sums only.
    keys, decay = k[..., None], decay[:, :, None, None]  # [T, H, K, 1], [T, H, 1, 1]
    queries, beta = (q * scale)[..., None], beta[..., None]  # [T, H, K, 1], [T, H, 1]
    for seqs, rows in steps:
        key = keys[rows]
        state = states[seqs] * decay[rows]
        delta = beta[rows] * (v[rows] - (key * state).sum(-2))  # [n, H, V]
        state = state + key * delta[:, :, None, :]
        out[rows] = (queries[rows] * state).sum(-2)
        states[seqs] = state
        steps.keep_cuts(rows, state)
    return DeltaRuleOutput(out.to(inputs.v.dtype), states, steps.cut_states(states))

"""Plain-PyTorch gated delta rule (the linear attention of Qwen3-Next / Qwen3.5) over varlen
batches: the CPU serving path and the oracle of the GPU kernels.

Per value head, with a state S `[key_dim, value_dim]`, each token t does

    S <- exp(g_t) * S                      (gated decay, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T   (delta rule: overwrite what k_t retrieves)
    o_t = S^T (scale * q_t)

Two exact forms: `recurrent_gated_delta_rule` steps token by token (all sequences at once, the
decode path), `chunked_gated_delta_rule` solves a unit lower-triangular system per chunk of
`chunk_size` tokens and carries the state between chunks (the prefill path). Both take the flat
tokens of a step cut by `query_start_loc`, an initial state per sequence, and `cut_positions`
(global token indices strictly inside a sequence) after which the state is also returned.
Query and key heads are shared by groups of value heads (q, k: `[T, Hk, K]`, v: `[T, Hv, V]`).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.batch_invariant import PointwiseFn, direct
from kernels.mamba_reference import as_host_list, seq_of_positions


class DeltaRuleOutput(NamedTuple):
    """Output of a gated delta rule kernel: o and the states the step leaves."""

    out: torch.Tensor  # [num_tokens, Hv, V], dtype of v
    final_states: torch.Tensor  # [num_seqs, Hv, K, V], fp32 (fp64 for fp64 inputs)
    cut_states: torch.Tensor  # [num_cuts, Hv, K, V]


class DeltaRuleInputs(NamedTuple):
    """The per-token inputs of a gated delta rule kernel."""

    q: torch.Tensor  # [T, Hk, K] (l2-normalised by the caller when the model asks)
    k: torch.Tensor  # [T, Hk, K]
    v: torch.Tensor  # [T, Hv, V]
    g: torch.Tensor  # [T, Hv] log decay
    beta: torch.Tensor  # [T, Hv]

    def rows(self, index: torch.Tensor) -> DeltaRuleInputs:
        return DeltaRuleInputs(*(x[index] for x in self))


CoreFn = Callable[
    [DeltaRuleInputs, torch.Tensor, list[int], float], tuple[torch.Tensor, torch.Tensor]
]
"""(inputs, initial states, query_start_loc, scale) -> (out, final states); no cuts."""


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (the models' q/k normalisation)."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when the inputs are fp64 (exactness tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def expand_heads(inputs: DeltaRuleInputs) -> DeltaRuleInputs:
    """q and k repeated so every value head has its own (Hk -> Hv), in the compute dtype."""
    dtype = compute_dtype(inputs.v)
    ratio = inputs.v.shape[1] // inputs.q.shape[1]
    q, k = (x.to(dtype).repeat_interleave(ratio, dim=1) for x in (inputs.q, inputs.k))
    return DeltaRuleInputs(q, k, inputs.v.to(dtype), inputs.g.to(dtype), inputs.beta.to(dtype))


def _chunk(
    x: DeltaRuleInputs, state: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence: head-major `[H, L, *]` inputs, state `[H, K, V]`."""
    q, k, v, g, beta = x
    length = q.shape[1]
    cum = g.cumsum(-1)  # [H, L]
    lower = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    diff = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
    # (I + A) delta = beta * (v - exp(G) K S0), A[i, j] = beta_i exp(G_i - G_j) k_i.k_j, j < i
    system = (beta[:, :, None] * (k @ k.transpose(1, 2)) * diff).tril(-1)
    system = system + torch.eye(length, dtype=q.dtype, device=q.device)
    rhs = beta[:, :, None] * (v - cum.exp()[:, :, None] * (k @ state))
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    qs = q * scale
    out = cum.exp()[:, :, None] * (qs @ state) + ((qs @ k.transpose(1, 2)) * diff) @ delta
    tail = (cum[:, -1:] - cum).exp()  # [H, L]
    new_state = (
        cum[:, -1].exp()[:, None, None] * state + (k * tail[:, :, None]).transpose(1, 2) @ delta
    )
    return out, new_state


def _chunked_core(
    inputs: DeltaRuleInputs, states: torch.Tensor, starts: list[int], scale: float, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x = expand_heads(inputs)
    out = torch.empty_like(x.v)
    finals = []
    for seq in range(len(starts) - 1):
        state = states[seq].to(x.v.dtype)
        for begin in range(starts[seq], starts[seq + 1], chunk_size):
            end = min(begin + chunk_size, starts[seq + 1])
            part = DeltaRuleInputs(*(t[begin:end].transpose(0, 1) for t in x))
            chunk_out, state = _chunk(part, state, scale)
            out[begin:end] = chunk_out.transpose(0, 1)
        finals.append(state)
    return out, _stack(finals, states, x.v.dtype)


def reference_chunked_core(
    inputs: DeltaRuleInputs, states: torch.Tensor, starts: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked core (64-token chunks, no cuts) for backends that cannot run some inputs."""
    return _chunked_core(inputs, states, starts, scale, 64)


def _recurrent_core(
    inputs: DeltaRuleInputs, states: torch.Tensor, starts: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence steps together; shorter ones stop updating once their tokens are done."""
    x = expand_heads(inputs)
    lengths = [end - begin for begin, end in itertools.pairwise(starts)]
    state = states.to(x.v.dtype).clone()  # [N, H, K, V]
    out = torch.empty_like(x.v)
    for step in range(max(lengths, default=0)):
        seqs = [s for s, n in enumerate(lengths) if n > step]
        every = len(seqs) == len(lengths)
        rows = torch.tensor([starts[s] + step for s in seqs], device=x.v.device)
        q, k, v, g, beta = x.rows(rows)
        current = state if every else state[seqs]  # decode: update in place, no gather
        current.mul_(g.exp()[:, :, None, None])
        recalled = (k[:, :, None, :] @ current).squeeze(2)  # [n, H, V]
        delta = beta[..., None] * (v - recalled)
        n, heads, dim_k, dim_v = current.shape  # += k delta^T as a batched outer product
        current.view(n * heads, dim_k, dim_v).baddbmm_(
            k.reshape(n * heads, dim_k, 1), delta.reshape(n * heads, 1, dim_v)
        )
        out[rows] = ((q * scale)[:, :, None, :] @ current).squeeze(2)
        if not every:
            state[seqs] = current
    return out, state


def _stack(finals: list[torch.Tensor], states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if finals:
        return torch.stack(finals)
    return states.to(dtype)


def run_with_cuts(
    core: CoreFn,
    inputs: DeltaRuleInputs,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    scale: float,
    cut_positions: Sequence[int],
) -> DeltaRuleOutput:
    """Run `core` (no cut support) so that states at `cut_positions` come out too.

    Each sequence is split at its cuts into segments; round r runs every sequence's r-th
    segment as one varlen batch, starting from the state round r - 1 left.
    """
    starts = as_host_list(query_start_loc)
    cuts = sorted(int(p) for p in cut_positions)
    if not cuts:
        out, final = core(inputs, initial_states, starts, scale)
        return DeltaRuleOutput(out.to(inputs.v.dtype), final, final[:0])
    owners, cut_set = seq_of_positions(starts, cuts), set(cuts)
    bounds = [[starts[s]] for s in range(len(starts) - 1)]
    for pos, seq in zip(cuts, owners, strict=True):
        bounds[seq].append(pos)
    for seq, seq_bounds in enumerate(bounds):
        seq_bounds.append(starts[seq + 1])
    states = initial_states.to(compute_dtype(inputs.v)).clone()
    out = torch.empty_like(inputs.v)
    cut_states: dict[int, torch.Tensor] = {}
    for rnd in range(max(len(b) for b in bounds) - 1):
        seqs = [s for s, b in enumerate(bounds) if len(b) - 1 > rnd]
        spans = [(bounds[s][rnd], bounds[s][rnd + 1]) for s in seqs]
        rows = torch.cat([torch.arange(a, b, device=inputs.v.device) for a, b in spans])
        local = [0]
        for a, b in spans:
            local.append(local[-1] + b - a)
        part_out, part_final = core(inputs.rows(rows), states[seqs], local, scale)
        out[rows] = part_out.to(out.dtype)
        states[seqs] = part_final.to(states.dtype)
        for idx, (_, end) in enumerate(spans):
            if end in cut_set:
                cut_states[end] = part_final[idx]
    cut = torch.stack([cut_states[p] for p in cuts]).to(states.dtype)
    return DeltaRuleOutput(out, states, cut)


def chunked_gated_delta_rule(
    inputs: DeltaRuleInputs,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    scale: float,
    cut_positions: Sequence[int] = (),
    chunk_size: int = 64,
) -> DeltaRuleOutput:
    """The chunked (prefill) form; see the module docstring."""
    core = functools.partial(_chunked_core, chunk_size=chunk_size)
    return run_with_cuts(core, inputs, initial_states, query_start_loc, scale, cut_positions)


def recurrent_gated_delta_rule(
    inputs: DeltaRuleInputs,
    initial_states: torch.Tensor,
    query_start_loc: torch.Tensor | Sequence[int],
    scale: float,
    cut_positions: Sequence[int] = (),
) -> DeltaRuleOutput:
    """The token-by-token (decode) form; see the module docstring."""
    return run_with_cuts(
        _recurrent_core, inputs, initial_states, query_start_loc, scale, cut_positions
    )


def naive_gated_delta_rule(
    inputs: DeltaRuleInputs, initial_state: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, one token and one head at a time, in float64: the exactness oracle.

    Returns (out `[T, Hv, V]`, final state `[Hv, K, V]`)."""
    x = DeltaRuleInputs(*(t.double() for t in inputs))
    ratio = x.v.shape[1] // x.q.shape[1]
    state = initial_state.double().clone()
    out = torch.zeros_like(x.v)
    for t in range(x.v.shape[0]):
        for h in range(x.v.shape[1]):
            q, k = x.q[t, h // ratio], x.k[t, h // ratio]
            s = state[h] * torch.exp(x.g[t, h])
            error = x.v[t, h] - k @ s
            s = s + torch.outer(k, x.beta[t, h] * error)
            out[t, h] = (q * scale) @ s
            state[h] = s
    return out, state


def gate_and_beta(
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    pointwise: PointwiseFn = direct,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The models' log decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b)
    (`pointwise` applies softplus and sigmoid: the layer's `LayerMath.pointwise`)."""
    g = -a_log.float().exp() * pointwise(F.softplus, a.float() + dt_bias)
    return g, pointwise(torch.sigmoid, b)

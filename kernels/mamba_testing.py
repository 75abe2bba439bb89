"""Random Mamba-2 kernel inputs and naive token-by-token oracles, for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MambaBatch:
    """Inputs of one varlen step for the conv1d and the SSD scan."""

    qsl: list[int]
    xbc: torch.Tensor  # [T, conv_dim]
    conv_weight: torch.Tensor  # [conv_dim, width]
    conv_bias: torch.Tensor  # [conv_dim]
    conv_init: torch.Tensor  # [S, conv_dim, width - 1]
    x: torch.Tensor  # [T, H, P]
    dt: torch.Tensor  # [T, H]
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor  # [H]
    ssm_init: torch.Tensor  # [S, H, P, N]


def make_mamba_batch(  # noqa: PLR0913 (shape knobs)
    seqs: Sequence[tuple[int, bool]],
    heads: int = 4,
    groups: int = 1,
    head_dim: int = 8,
    state: int = 8,
    width: int = 4,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> MambaBatch:
    """One `(num_tokens, has_initial_state)` per sequence; absent states are zeros."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    lengths = [n for n, _ in seqs]
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    total, num = qsl[-1], len(seqs)
    has_init = torch.tensor([float(h) for _, h in seqs], device=device, dtype=dtype)
    conv_dim = heads * head_dim + 2 * groups * state
    return MambaBatch(
        qsl=qsl,
        xbc=rand(total, conv_dim),
        conv_weight=rand(conv_dim, width, scale=0.5),
        conv_bias=rand(conv_dim, scale=0.1),
        conv_init=rand(num, conv_dim, width - 1) * has_init[:, None, None],
        x=rand(total, heads, head_dim),
        dt=rand(total, heads, scale=0.5),
        A=-torch.exp(rand(heads, scale=0.5)),
        B=rand(total, groups, state, scale=0.5),
        C=rand(total, groups, state, scale=0.5),
        D=rand(heads),
        dt_bias=rand(heads, scale=0.1),
        ssm_init=rand(num, heads, head_dim, state) * has_init[:, None, None, None],
    )


def _seq_of(qsl: list[int], pos: int) -> int:
    return next(s for s in range(len(qsl) - 1) if qsl[s] <= pos < qsl[s + 1])


def naive_conv(
    batch: MambaBatch, cuts: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv output before activation, final states and cut states, one token at a time."""
    width_1 = batch.conv_weight.shape[1] - 1
    outs, finals, history = [], [], {}
    for seq in range(len(batch.qsl) - 1):
        window = batch.conv_init[seq].float().clone()  # [dim, width - 1]
        for t in range(batch.qsl[seq], batch.qsl[seq + 1]):
            history[t] = window.clone()
            full = torch.cat([window, batch.xbc[t].float()[:, None]], dim=1)
            outs.append((full * batch.conv_weight.float()).sum(1) + batch.conv_bias.float())
            window = full[:, 1:] if width_1 else full[:, :0]
        finals.append(window)
    cut_states = [history[p] for p in cuts]
    return torch.stack(outs), torch.stack(finals), _stack(cut_states, finals[0])


def naive_scan(
    batch: MambaBatch, cuts: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scan output, final states and cut states by the plain recurrence."""
    heads = batch.x.shape[1]
    per_group = heads // batch.B.shape[1]
    dt = F.softplus(batch.dt.float() + batch.dt_bias.float())
    outs, finals, history = [], [], {}
    for seq in range(len(batch.qsl) - 1):
        state = batch.ssm_init[seq].float().clone()  # [H, P, N]
        for t in range(batch.qsl[seq], batch.qsl[seq + 1]):
            history[t] = state.clone()
            b = batch.B[t].float().repeat_interleave(per_group, 0)  # [H, N]
            c = batch.C[t].float().repeat_interleave(per_group, 0)
            decay = torch.exp(dt[t] * batch.A.float())  # [H]
            x = batch.x[t].float()  # [H, P]
            state = state * decay[:, None, None] + (dt[t][:, None] * x)[:, :, None] * b[:, None]
            y = (state * c[:, None, :]).sum(-1) + batch.D.float()[:, None] * x
            outs.append(y)
        finals.append(state)
    return torch.stack(outs), torch.stack(finals), _stack([history[p] for p in cuts], finals[0])


def _stack(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.stack(tensors) if tensors else like.new_zeros(0, *like.shape)

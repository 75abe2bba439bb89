"""The gated DeltaNet's decode step (one token per sequence) in few torch calls: the causal conv
update and SiLU, l2-normalised q and k, the decay and beta, the delta-rule update and the output.

It keeps the numerics of the varlen path (`kernels.mamba_reference.causal_conv1d`, then
`kernels.gated_delta_reference`): conv products in fp32, q and k normalised in fp32 and rounded to
the activation dtype, the recurrent state in fp32. Value heads share key heads in groups; q and k
are repeated once for both. The torch delta-rule kernels carry it (`kernels.gated_delta_registry`);
the batch-invariant and static kernels keep their own decode.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.gated_delta_reference import gate_and_beta, l2_normalize


class DecodeStepInputs(NamedTuple):
    """One decode step of N sequences."""

    mixed: torch.Tensor  # [N, conv_dim] the projection's q | k | v before the conv
    a: torch.Tensor  # [N, Hv] decay input
    b: torch.Tensor  # [N, Hv] beta input
    conv_states: torch.Tensor  # [N, conv_dim, width - 1]
    states: torch.Tensor  # [N, Hv, K, V] fp32, a fresh tensor (updated in place)


class DecodeStepWeights(NamedTuple):
    """The layer's weights the step reads."""

    conv_weight: torch.Tensor  # [conv_dim, width]
    a_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]


class DecodeStepOutput(NamedTuple):
    """The step's output and the states it leaves."""

    out: torch.Tensor  # [N, Hv, V], dtype of `mixed`
    conv_states: torch.Tensor  # [N, conv_dim, width - 1]
    states: torch.Tensor  # [N, Hv, K, V] fp32


def gated_delta_decode_step(
    inputs: DecodeStepInputs, weights: DecodeStepWeights, num_k_heads: int, scale: float
) -> DecodeStepOutput:
    """One token per sequence through conv, normalisation, gating and the delta rule."""
    mixed, a, b, conv_states, states = inputs
    num_seqs, num_v_heads, dim_k, dim_v = states.shape
    window = torch.cat([conv_states.to(mixed.dtype), mixed[:, :, None]], dim=-1)  # [N, C, width]
    conv = F.silu((window.float() * weights.conv_weight.float()).sum(-1)).to(mixed.dtype)
    key_size = num_k_heads * dim_k
    qk = l2_normalize(conv[:, : 2 * key_size].view(num_seqs, 2, num_k_heads, dim_k)).float()
    if num_v_heads != num_k_heads:  # [N, 2, Hk, K] -> [N, 2, Hv, K]
        qk = qk.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    q, k = qk.unbind(1)
    v = conv[:, 2 * key_size :].view(num_seqs, num_v_heads, dim_v).float()
    g, beta = gate_and_beta(a, b, weights.a_log, weights.dt_bias)
    states.mul_(g.float().exp()[:, :, None, None])
    recalled = (k[:, :, None, :] @ states).squeeze(2)  # [N, Hv, V]
    delta = beta.float()[..., None] * (v - recalled)
    states.addcmul_(k[..., :, None], delta[..., None, :])  # += k delta^T
    out = ((q * scale)[:, :, None, :] @ states).squeeze(2)
    return DecodeStepOutput(out.to(mixed.dtype), window[:, :, 1:], states)

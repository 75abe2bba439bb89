"""The gated DeltaNet's fused decode step against the varlen path it replaces in decode steps:
the reference conv, l2 normalisation, gating and recurrent delta rule, one token per sequence."""

from __future__ import annotations

import pytest
import torch

from kernels.gated_delta_decode import DecodeStepInputs, DecodeStepWeights, gated_delta_decode_step
from kernels.gated_delta_reference import (
    DeltaRuleInputs,
    gate_and_beta,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from kernels.mamba_reference import causal_conv1d

NUM_SEQS, WIDTH, HEAD_K, HEAD_V = 5, 4, 8, 6


def _varlen_path(inputs: DecodeStepInputs, weights: DecodeStepWeights, num_k_heads: int):  # type: ignore[no-untyped-def]
    """What the layer runs without a fused step (as `GatedDeltaNet._mix`)."""
    starts = list(range(NUM_SEQS + 1))
    conv = causal_conv1d(inputs.mixed, weights.conv_weight, None, inputs.conv_states, starts)
    key_size = num_k_heads * HEAD_K
    q, k, v = conv.out.split([key_size, key_size, conv.out.shape[1] - 2 * key_size], dim=-1)
    g, beta = gate_and_beta(inputs.a, inputs.b, weights.a_log, weights.dt_bias)
    rule_inputs = DeltaRuleInputs(
        l2_normalize(q.reshape(NUM_SEQS, num_k_heads, HEAD_K)),
        l2_normalize(k.reshape(NUM_SEQS, num_k_heads, HEAD_K)),
        v.reshape(NUM_SEQS, -1, HEAD_V),
        g.float(),
        beta,
    )
    rule = recurrent_gated_delta_rule(rule_inputs, inputs.states, starts, HEAD_K**-0.5)
    return rule.out, conv.final_states, rule.final_states


@pytest.mark.parametrize(("num_k_heads", "num_v_heads"), [(2, 4), (3, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_step_matches_the_varlen_path(
    num_k_heads: int, num_v_heads: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    conv_dim = 2 * num_k_heads * HEAD_K + num_v_heads * HEAD_V
    inputs = DecodeStepInputs(
        torch.randn(NUM_SEQS, conv_dim).to(dtype),
        torch.randn(NUM_SEQS, num_v_heads).to(dtype),
        torch.randn(NUM_SEQS, num_v_heads).to(dtype),
        torch.randn(NUM_SEQS, conv_dim, WIDTH - 1).to(dtype),
        torch.randn(NUM_SEQS, num_v_heads, HEAD_K, HEAD_V),
    )
    weights = DecodeStepWeights(
        torch.randn(conv_dim, WIDTH).to(dtype),
        torch.randn(num_v_heads).to(dtype),
        torch.randn(num_v_heads).to(dtype),
    )
    want_out, want_conv, want_states = _varlen_path(inputs, weights, num_k_heads)
    fresh = inputs._replace(states=inputs.states.clone())
    got = gated_delta_decode_step(fresh, weights, num_k_heads, HEAD_K**-0.5)
    assert got.out.dtype == dtype
    assert torch.equal(got.conv_states, want_conv)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.out, want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(got.states, want_states, atol=1e-6, rtol=1e-6)

"""The fused Triton layer kernels ((residual add +) RMSNorm, in-place rotary, SiLU-and-mul, the
output-gated RMSNorm) against their torch versions, under the Triton interpreter (CPU tensors, a
fresh process)."""

from __future__ import annotations

import pytest

from kernels import HAS_TRITON
from tests.helpers.triton_subprocess import run_interpreted

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

CODE = """
import torch
from kernels import layer_ops_reference as torch_ops
from kernels.layer_ops_registry import select_layer_kernels
kernels = select_layer_kernels("cpu")
assert kernels.name == "triton", kernels.name
torch.manual_seed(0)
for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    # hidden 72: not a power of two (masked columns); rows of a strided view
    x = torch.randn(5, 100)[:, :72].to(dtype)
    residual, weight = torch.randn(5, 72).to(dtype), torch.randn(72).to(dtype)
    for fp32_scale in (False, True):
        scale = weight.float() + 1.0 if fp32_scale else weight  # a Gemma norm's folded 1 + w
        want = torch_ops.rms_norm(x, scale, 1e-6, fp32_scale)
        torch.testing.assert_close(kernels.rms_norm(x, scale, 1e-6, fp32_scale), want,
                                   atol=atol, rtol=atol)
        got, got_sum = kernels.add_rms_norm(x, residual, scale, 1e-6, fp32_scale)
        want, want_sum = torch_ops.add_rms_norm(x, residual, scale, 1e-6, fp32_scale)
        torch.testing.assert_close(got_sum, want_sum, atol=atol, rtol=atol)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    # queries and keys adjacent in a qkv row: 3 + 2 heads of 16 rotated, 2 value heads kept
    for rotary_dim in (16, 8):
        qkv = torch.randn(4, 7 * 16).to(dtype)
        cos, sin = torch.randn(4, 1, rotary_dim).to(dtype), torch.randn(4, 1, rotary_dim).to(dtype)
        want = qkv.clone()
        torch_ops.rotate_in_place(want[:, :80].unflatten(-1, (5, 16)), cos, sin)
        kernels.rotate_in_place(qkv[:, :80].unflatten(-1, (5, 16)), cos, sin)
        torch.testing.assert_close(qkv, want, atol=atol, rtol=atol)
        assert torch.equal(qkv[:, 80:], want[:, 80:])
    gate_up = torch.randn(3, 2 * 40).to(dtype)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up),
                               atol=atol, rtol=atol)
    assert kernels.silu_and_mul(gate_up[:0]).shape == (0, 40)
    # the gated DeltaNet's output norm: [tokens, value heads, 12] (not a power of two), a z view
    heads, z = torch.randn(3, 4, 12).to(dtype), torch.randn(3, 4 * 24).to(dtype)[:, :48]
    for norm_weight in (torch.randn(12).to(dtype), torch.randn(12)):
        z_heads = z.view(3, 4, 12)
        torch.testing.assert_close(kernels.gated_rms_norm(heads, z_heads, norm_weight, 1e-6),
                                   torch_ops.gated_rms_norm(heads, z_heads, norm_weight, 1e-6),
                                   atol=atol, rtol=atol)
"""


def test_triton_layer_kernels_match_torch_versions() -> None:
    run_interpreted("", CODE, timeout=300)

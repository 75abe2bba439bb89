"""The fused Triton layer kernels ((residual add +) RMSNorm, in-place rotary, SiLU-and-mul)
against their torch versions on CUDA, at Llama-8B-like sizes, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from kernels import layer_ops_reference as torch_ops
from kernels.layer_ops_registry import select_layer_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
NUM_TOKENS = (1, 64, 300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_matches_torch(dtype: torch.dtype, num_tokens: int, unit_offset: bool) -> None:
    kernels = select_layer_kernels("cuda")
    assert kernels.name == "triton"
    torch.manual_seed(num_tokens)
    x, residual = (torch.randn(num_tokens, 4096, device="cuda").to(dtype) for _ in range(2))
    weight = torch.randn(4096, device="cuda").to(dtype)
    atol = ATOL[dtype]
    got = kernels.rms_norm(x, weight, 1e-5, unit_offset)
    want = torch_ops.rms_norm(x, weight, 1e-5, unit_offset)
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    got, got_sum = kernels.add_rms_norm(x, residual, weight, 1e-5, unit_offset)
    want, want_sum = torch_ops.add_rms_norm(x, residual, weight, 1e-5, unit_offset)
    torch.testing.assert_close(
        got_sum, want_sum, atol=0 if dtype == torch.float32 else atol, rtol=0
    )
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("rotary_dim", [128, 64])
def test_rotary_in_place_matches_torch(
    dtype: torch.dtype, num_tokens: int, rotary_dim: int
) -> None:
    kernels = select_layer_kernels("cuda")
    torch.manual_seed(rotary_dim)
    # 32 query and 8 key heads of 128 rotated inside a qkv row; the 8 value heads untouched.
    qkv = torch.randn(num_tokens, 48 * 128, device="cuda").to(dtype)
    cos = torch.randn(num_tokens, 1, rotary_dim, device="cuda").to(dtype)
    sin = torch.randn(num_tokens, 1, rotary_dim, device="cuda").to(dtype)
    want = qkv.clone()
    torch_ops.rotate_in_place(want[:, : 40 * 128].unflatten(-1, (40, 128)), cos, sin)
    kernels.rotate_in_place(qkv[:, : 40 * 128].unflatten(-1, (40, 128)), cos, sin)
    torch.testing.assert_close(qkv, want, atol=ATOL[dtype], rtol=ATOL[dtype])
    assert torch.equal(qkv[:, 40 * 128 :], want[:, 40 * 128 :])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul_matches_torch(dtype: torch.dtype, num_tokens: int) -> None:
    kernels = select_layer_kernels("cuda")
    gate_up = torch.randn(num_tokens, 2 * 14336, device="cuda").to(dtype)
    torch.testing.assert_close(
        kernels.silu_and_mul(gate_up),
        torch_ops.silu_and_mul(gate_up),
        atol=ATOL[dtype],
        rtol=ATOL[dtype],
    )

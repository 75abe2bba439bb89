"""Quantized-weight GEMMs on CUDA against the dequantized torch references at model shapes
(Llama-8B, Qwen3-Next, gpt-oss-20b) for decode (1, 64 tokens) and prefill (2048 tokens), bf16
activations. Tolerance: max |error| over max |output| below 2e-2 (bf16 outputs and bf16
weights in the dot; the FP8 kernel's activation rounding may differ from torch's on ties)."""

from __future__ import annotations

import pytest
import torch

from kernels import quant_reference as ref
from kernels.quant_testing import (
    expert_offsets,
    random_fp8_block_weight,
    random_int4_weight,
    random_mxfp4_weight,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = 2e-2
TOKENS = (1, 64, 2048)
DENSE_SHAPES = {"llama8b_qkv": (6144, 4096), "llama8b_down": (4096, 14336),
                "qwen3next_in_proj": (12288, 2048), "odd": (1000, 2000)}  # fmt: skip


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _activations(tokens: int, cols: int) -> torch.Tensor:
    return torch.randn(tokens, cols, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", list(DENSE_SHAPES))
def test_fp8_block_gemm_matches_reference(tokens: int, shape: str) -> None:
    from kernels.triton_quant_fp8 import fp8_block_gemm, fp8_gemm_supported

    if not fp8_gemm_supported(torch.device("cuda")):
        pytest.skip("FP8 tensor cores need sm_89+")
    rows, cols = DENSE_SHAPES[shape]
    weight = random_fp8_block_weight(rows, cols, (128, 128), "cuda", seed=tokens)
    x = _activations(tokens, cols)
    got = fp8_block_gemm(x, weight.weight, weight.scale_inv)
    assert got.dtype == torch.bfloat16
    assert relative_error(got, ref.fp8_block_gemm(x, weight.weight, weight.scale_inv)) < TOLERANCE


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_scaled_mm_matches_reference(tokens: int, per_channel: bool) -> None:
    from kernels.quant_scaled_mm import fp8_scaled_mm, scaled_mm_applies

    weight = torch.randn(14336, 4096, device="cuda").to(torch.float8_e4m3fn)
    scale = torch.rand(14336 if per_channel else 1, device="cuda") * 0.02 + 0.01
    x = _activations(tokens, 4096)
    if not scaled_mm_applies(x, weight, scale):
        pytest.skip("rowwise torch._scaled_mm needs sm_90")
    got = fp8_scaled_mm(x, weight, scale)
    assert relative_error(got, ref.fp8_channel_gemm(x, weight, scale)) < TOLERANCE


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("shape", ["llama8b_down", "odd"])
def test_int4_gemm_matches_reference(
    tokens: int, group: int, zero_points: bool, shape: str
) -> None:
    from kernels.triton_quant_moe import int4_gemm

    rows, cols = DENSE_SHAPES[shape]
    w = random_int4_weight((rows, cols), group, zero_points, torch.bfloat16, "cuda", seed=group)
    x = _activations(tokens, cols)
    got = int4_gemm(x, w.qweight, w.scales, w.zeros, group)
    assert relative_error(got, ref.int4_gemm(x, w.qweight, w.scales, w.zeros, group)) < TOLERANCE


def _routed_counts(tokens: int, experts: int, top_k: int, seed: int) -> list[int]:
    """Tokens per expert for random top-k routing; some experts get none at decode sizes."""
    gen = torch.Generator().manual_seed(seed)
    choices = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    return torch.bincount(choices.flatten(), minlength=experts).tolist()


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("projection", ["gate_up", "down"])
def test_mxfp4_moe_matches_reference_at_gpt_oss_20b_shapes(tokens: int, projection: str) -> None:
    from kernels.triton_quant_moe import mxfp4_moe_gemm

    rows = 5760 if projection == "gate_up" else 2880
    weight = random_mxfp4_weight(32, rows, 2880, "cuda", seed=tokens)
    counts = _routed_counts(tokens, 32, 4, tokens)
    offsets = expert_offsets(counts, "cuda")
    x = _activations(sum(counts), 2880)
    bias = (torch.randn(32, rows, device="cuda") * 0.1).to(torch.bfloat16)
    got = mxfp4_moe_gemm(x, offsets, weight.blocks, weight.scales, bias)
    want = ref.mxfp4_moe_gemm(x, offsets, weight.blocks, weight.scales, bias)
    assert relative_error(got, want) < TOLERANCE


@pytest.mark.parametrize("tokens", TOKENS)
def test_int4_moe_matches_reference_at_qwen3_next_shapes(tokens: int) -> None:
    """512 experts, top-10: most experts get no token at decode sizes."""
    from kernels.triton_quant_moe import int4_moe_gemm

    w = random_int4_weight((512, 1024, 2048), 128, True, torch.bfloat16, "cuda", seed=tokens)
    counts = _routed_counts(tokens, 512, 10, tokens)
    offsets = expert_offsets(counts, "cuda")
    x = _activations(sum(counts), 2048)
    got = int4_moe_gemm(x, offsets, w.qweight, w.scales, w.zeros, 128)
    want = ref.int4_moe_gemm(x, offsets, w.qweight, w.scales, w.zeros, 128)
    assert relative_error(got, want) < TOLERANCE

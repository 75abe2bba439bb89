"""The quantized-weight references against a plain dequantize-then-matmul in fp32, where the
dense weight is built from the raw codes (`kernels.quant_testing`), not by the reference.

Tolerances (max |error| over max |output|): weight-only int4 and MXFP4 1e-5 (the weights are
exact in fp32); FP8 with activations quantized at run time 5e-2 (e4m3 keeps 3 mantissa bits).
"""

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

EXACT = 1e-5
FP8_ACTIVATIONS = 5e-2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_fp8_block_reference_is_the_dequantized_matmul_up_to_activation_rounding(
    block: tuple[int, int],
) -> None:
    weight = random_fp8_block_weight(130, 200, block, "cpu")  # N, K not multiples of the block
    x = torch.randn(9, 200)
    got = ref.fp8_block_gemm(x, weight.weight, weight.scale_inv, block)
    assert torch.equal(ref.dequantize_fp8_block(weight.weight, weight.scale_inv, block),
                       weight.dense)  # fmt: skip
    assert relative_error(got, x @ weight.dense.T) < FP8_ACTIVATIONS


def test_fp8_activation_groups_keep_every_value_within_e4m3_rounding() -> None:
    x = torch.randn(5, 300) * torch.logspace(-3, 3, 300)  # groups of very different ranges
    values, scales = ref.quantize_fp8_groups(x, 128)
    assert scales.shape == (5, 3)
    back = values.float() * scales.repeat_interleave(128, 1)[:, :300]
    group_max = x.abs().view(5, -1).amax(1, keepdim=True)
    assert float(values.float().abs().max()) == ref.FP8_MAX
    assert ((back - x).abs() <= x.abs() / 16 + group_max * 2**-9 / ref.FP8_MAX).all()


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("static_input", [False, True])
def test_fp8_channel_reference_and_scaled_mm(per_channel: bool, static_input: bool) -> None:
    from kernels.quant_scaled_mm import fp8_scaled_mm, scaled_mm_applies

    torch.manual_seed(1)
    weight = torch.randn(48, 80).to(torch.float8_e4m3fn)
    scale = torch.rand(48) * 0.05 + 0.01 if per_channel else torch.tensor([0.03])
    x = torch.randn(7, 80)
    input_scale = x.abs().max() / ref.FP8_MAX if static_input else None
    want = ref.fp8_channel_gemm(x, weight, scale, input_scale)
    dense = weight.float() * scale.reshape(-1, 1)
    assert relative_error(want, x @ dense.T) < FP8_ACTIVATIONS
    if not scaled_mm_applies(x, weight, scale, input_scale):
        pytest.skip("torch._scaled_mm does not run here")
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8_scaled_mm(x.to(dtype), weight, scale, input_scale)
        assert got.dtype == dtype
        assert relative_error(got, ref.fp8_channel_gemm(x.to(dtype), weight, scale,
                                                         input_scale)) < 1e-2  # fmt: skip


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("zero_points", [False, True])
def test_int4_reference_is_the_dequantized_matmul(group: int, zero_points: bool) -> None:
    weight = random_int4_weight((37, 200), group, zero_points, torch.float32, "cpu")
    x = torch.randn(6, 200)
    assert weight.qweight.shape == (37, 25)
    assert torch.equal(ref.pack_int4(ref.unpack_int4(weight.qweight, 200)), weight.qweight)
    got = ref.int4_gemm(x, weight.qweight, weight.scales, weight.zeros, group)
    assert relative_error(got, x @ weight.dense.T) < EXACT


def test_mxfp4_codes_decode_low_nibble_first_with_e8m0_scales() -> None:
    """The format's own definition on one byte: low nibble 0b0001 (+0.5), high 0b1111 (-6),
    exponent 128 (2^1)."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0xF1
    values = ref.dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))
    assert values.shape == (1, 32)
    assert values[0, :3].tolist() == [1.0, -12.0, 0.0]


@pytest.mark.parametrize("kind", ["mxfp4", "int4"])
def test_moe_references_are_per_expert_dequantized_matmuls(kind: str) -> None:
    counts = [3, 0, 5, 0, 1]  # experts without tokens, first and last included
    offsets = expert_offsets(counts, "cpu")
    x = torch.randn(sum(counts), 96)
    bias = torch.randn(5, 37)
    if kind == "mxfp4":
        mx = random_mxfp4_weight(5, 37, 96, "cpu")
        dense = mx.dense
        got = ref.mxfp4_moe_gemm(x, offsets, mx.blocks, mx.scales, bias)
    else:
        q = random_int4_weight((5, 37, 96), 32, True, torch.float32, "cpu")
        dense = q.dense
        got = ref.int4_moe_gemm(x, offsets, q.qweight, q.scales, q.zeros, 32, bias)
    experts = torch.repeat_interleave(torch.arange(5), torch.tensor(counts))
    want = torch.einsum("tk,tnk->tn", x, dense[experts]) + bias[experts]
    assert relative_error(got, want) < EXACT

"""Quantized-weight GEMMs in plain torch: the oracle of the Triton kernels and their CPU path.

Canonical layouts (what the kernels consume; checkpoint formats are converted to these):

- Block-scaled FP8 (`quant_method: fp8`, `weight_block_size [128, 128]`, the Qwen3 "-FP8"
  releases): `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32
  [ceil(N/bn), ceil(K/bk)], multiplied in to dequantize. Activations are quantized at run time
  per token per `bk` channels to e4m3 with one float32 scale each (`amax / 448`).
- Per-tensor / per-channel FP8 (compressed-tensors W8A8-FP8): `weight` e4m3 [N, K] and
  `weight_scale` float32 of one element (per tensor) or [N] / [N, 1] (per output channel);
  activations per token (dynamic) or with a static per-tensor `input_scale`.
- Int4 weight-only (W4A16: compressed-tensors pack-quantized, GPTQ, AWQ): `qweight` int32
  [N, ceil(K/8)] holding unsigned nibbles u in [0, 15], 8 along K per word, element k in bits
  4*(k % 8) (low nibble first); `scales` [N, ceil(K/group)] in the activation dtype; `zeros`
  uint8 [N, ceil(K/group)] (unsigned zero points) or None for symmetric (zero point 8).
  w = (u - zero) * scale. Group sizes 32 and 128 (any size that is a multiple of 8 works).
- MXFP4 experts (gpt-oss): `blocks` uint8 [E, N, K/32, 16], two e2m1 codes per byte, low
  nibble first (code order +0 .5 1 1.5 2 3 4 6 -0 -.5 -1 -1.5 -2 -3 -4 -6); `scales` uint8
  [E, N, K/32], e8m0 exponents: scale 2^(s - 127).
- Int4 experts: the int4 layout above with a leading expert dimension.

Grouped (MoE) GEMMs take the tokens sorted by expert and `expert_offsets` int32 [E + 1]:
expert e owns rows expert_offsets[e]:expert_offsets[e + 1] (empty for experts without tokens).
All references compute in float32 and return the activation dtype.
"""

from __future__ import annotations

import itertools

import torch

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
FP8_SCALE_EPS = 1e-10
"""Smallest activation amax a scale is made from (an all-zero group gets a tiny scale)."""
INT4_SYMMETRIC_ZERO = 8
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
"""The e2m1 value of each 4-bit code."""
MXFP4_BLOCK = 32


def quantize_fp8_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/group)]): per token per `group`
    channels, scale = amax / 448, value = x / scale."""
    rows, cols = x.shape
    num_groups = -(-cols // group)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group - cols))
    grouped = padded.view(rows, num_groups, group)
    scales = grouped.abs().amax(dim=2).clamp(min=FP8_SCALE_EPS) / FP8_MAX
    values = (grouped / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return values.view(rows, -1)[:, :cols].to(torch.float8_e4m3fn), scales


def expand_scales(
    scales: torch.Tensor, rows: int, cols: int, block: tuple[int, int]
) -> torch.Tensor:
    """One scale per [block] tile -> one per element of a [rows, cols] matrix."""
    expanded = scales.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return expanded[..., :rows, :cols]


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """e4m3 [N, K] times its per-block float32 scales -> float32 [N, K]."""
    return weight.float() * expand_scales(
        scale_inv.float(), weight.shape[-2], weight.shape[-1], block
    )


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
) -> torch.Tensor:
    """x [M, K] @ W^T with W block-scaled e4m3 and x quantized per token per block[1] channels."""
    x_q, x_scales = quantize_fp8_groups(x, block[1])
    x_deq = x_q.float() * expand_scales(x_scales, x.shape[0], x.shape[1], (1, block[1]))
    return (x_deq @ dequantize_fp8_block(weight, scale_inv, block).T).to(x.dtype)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 [M, 1]): one dynamic scale per token."""
    scales = x.float().abs().amax(dim=1, keepdim=True).clamp(min=FP8_SCALE_EPS) / FP8_MAX
    return (x.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def quantize_fp8_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """[M, K] -> e4m3 with the checkpoint's per-tensor `input_scale`."""
    return (x.float() / input_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_channel_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W^T with W e4m3 scaled per tensor or per output channel, x quantized per token
    (or per tensor with a static `input_scale`)."""
    if input_scale is None:
        x_q, x_scale = quantize_fp8_rows(x)
    else:
        x_q, x_scale = quantize_fp8_static(x, input_scale), input_scale.float().reshape(1, 1)
    w_deq = weight.float() * weight_scale.float().reshape(-1, 1)
    return ((x_q.float() * x_scale) @ w_deq.T).to(x.dtype)


def unpack_int4(qweight: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 [..., ceil(K/8)] -> uint8 nibbles [..., K], low nibble first."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    nibbles = (qweight[..., None] >> shifts) & 0xF
    return nibbles.flatten(-2)[..., :cols].to(torch.uint8)


def pack_int4(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] values in [0, 15] -> int32 [..., ceil(K/8)] (padding nibbles are 0)."""
    cols = nibbles.shape[-1]
    padded = torch.nn.functional.pad(nibbles.to(torch.int64), (0, -cols % 8))
    words = padded.view(*nibbles.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, device=nibbles.device, dtype=torch.int64)
    packed = (words << shifts).sum(dim=-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int, cols: int
) -> torch.Tensor:
    """Canonical int4 (any leading dims) -> float32 [..., N, K]: (u - zero) * scale."""
    values = unpack_int4(qweight, cols).float()
    scale = scales.float().repeat_interleave(group, -1)[..., :cols]
    if zeros is None:
        return (values - INT4_SYMMETRIC_ZERO) * scale
    return (values - zeros.float().repeat_interleave(group, -1)[..., :cols]) * scale


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """x [M, K] @ W^T with W canonical int4 [N, K] (weight-only: x stays in its dtype)."""
    weight = dequantize_int4(qweight, scales, zeros, group, x.shape[1])
    return (x.float() @ weight.T).to(x.dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/32, 16] e2m1 pairs and uint8 [..., K/32] e8m0 scales -> float32 [..., K]."""
    table = torch.tensor(FP4_VALUES, device=blocks.device)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)
    values = table[codes.long()]
    powers = torch.exp2(scales.float() - 127.0)
    return (values * powers[..., None]).flatten(-2)


def grouped_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weights: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens sorted by expert [T, K], float weights [E, N, K] -> [T, N] in x's dtype."""
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float32, device=x.device)
    bounds = expert_offsets.tolist()
    for expert, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            out[start:end] = x[start:end].float() @ weights[expert].float().T
            if bias is not None:
                out[start:end] += bias[expert].float()
    return out.to(x.dtype)


def mxfp4_moe_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each expert's rows of x [T, K] @ its dequantized MXFP4 weight^T (+ bias [E, N])."""
    return grouped_gemm(x, expert_offsets, dequantize_mxfp4(blocks, scales), bias)


def int4_moe_gemm(  # noqa: PLR0913 (the signature shared with the Triton kernel)
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each expert's rows of x [T, K] @ its dequantized int4 weight^T (+ bias [E, N])."""
    weights = dequantize_int4(qweight, scales, zeros, group, x.shape[1])
    return grouped_gemm(x, expert_offsets, weights, bias)

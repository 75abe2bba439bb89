"""The decoder layer's elementwise operations in plain PyTorch, in as few torch calls as each
allows: RMSNorm (optionally after a residual add), rotary embedding applied in place, SiLU-and-mul,
and the output-gated RMSNorm of the gated DeltaNet.

They are the CPU path and the oracle of the Triton kernels (`kernels.triton_layer_ops`, same
signatures). Numerics follow transformers: RMS statistics in fp32; a Llama-style norm casts the
normalised rows to the input dtype and then multiplies by `weight`, a Gemma-style norm
(`fp32_scale`) multiplies the fp32 rows by its fp32 scale `1 + w` (folded into the weight when
it is loaded) and casts last; rotary products are in the activation dtype with the tables cast
to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_scale: bool) -> torch.Tensor:
    """[..., hidden] -> RMS-normalised rows scaled by `weight`: in fp32 before the cast back when
    `fp32_scale` (Gemma's `1 + w`, an fp32 weight), after it otherwise (Llama's order)."""
    if fp32_scale:
        if x.dtype == torch.float32:
            return _fused_rms_norm(x, weight, eps)
        return _fused_rms_norm(x.float(), weight, eps).to(x.dtype)
    if x.dtype == weight.dtype == torch.float32:
        return _fused_rms_norm(x, weight, eps)
    # NOTE: rows rounded to x's dtype before the scale, as transformers' Llama norm does.
    return _fused_rms_norm(x, None, eps) * weight


def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """torch's fused RMSNorm over the last dimension (one call on CPU; it also returns rstd)."""
    normed: torch.Tensor = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
    return normed


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fp32_scale: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's residual add and norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps, fp32_scale), summed


def rotate_in_place(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate `x` [T, heads, head_size] in place (neox layout: the halves of the first
    `rotary_dim` features pair up); writes `x`.

    `cos` and `signed_sin` are [T, 1, rotary_dim] in x's dtype; `signed_sin` is
    `cat(-sin_half, sin_half)`, so x * cos + swap_halves(x) * signed_sin is transformers'
    x * cos + rotate_half(x) * sin with the same products.
    """
    rotary_dim = cos.shape[-1]
    rotated = x if rotary_dim == x.shape[-1] else x[..., :rotary_dim]
    swapped = rotated.view(*rotated.shape[:-1], 2, rotary_dim // 2).flip(-2).flatten(-2)
    rotated.mul_(cos).addcmul_(swapped, signed_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: silu(gate) * up of a merged gate/up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """[..., d] -> weight * RMSNorm(x) (rounded to x's dtype) * silu(gate), the product in fp32
    and cast last: the gated DeltaNet's output norm (transformers' `RMSNormGated`)."""
    if x.dtype == weight.dtype == torch.float32:
        return _fused_rms_norm(x, weight, eps) * F.silu(gate.float())
    scaled = weight * _fused_rms_norm(x, None, eps)
    return (scaled * F.silu(gate.float())).to(x.dtype)

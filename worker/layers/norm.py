"""RMSNorm as transformers computes it: statistics in fp32, then the learned scale.

Llama-style norms multiply by `w` after casting back to the input dtype; Gemma-style norms
multiply the fp32 result by `(1 + w)` and cast last. Both orders are kept for bit-close parity.
`unscaled_rms` normalises without a learned scale.
"""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.loading import default_weight_loader, new_parameter


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        fill = 0.0 if add_unit_offset else 1.0
        self.weight = new_parameter((hidden_size,), default_weight_loader, fill=fill)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.add_unit_offset:
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, add_unit_offset={self.add_unit_offset}"


def unscaled_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalization without a learned scale (Gemma 3n / 4's value norm), in fp32."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)

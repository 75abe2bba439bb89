"""RMSNorm as transformers computes it: statistics in fp32, then the learned scale.

Llama-style norms multiply by `w` after casting back to the input dtype; Gemma-style norms
multiply the fp32 result by `(1 + w)` and cast last. Both orders are kept for bit-close parity.
The work runs on the device's layer kernels (`kernels.layer_ops_registry`: one fused Triton
launch on CUDA, the fewest torch calls elsewhere); `add_and_norm` fuses the residual add before
it. `unscaled_rms` normalises without a learned scale.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops_registry import LayerKernels, select_layer_kernels
from worker.layers.loading import default_weight_loader, new_parameter


def layer_kernels() -> LayerKernels:
    """The layer kernels of the device the model is being built on (the default device)."""
    return select_layer_kernels(torch.get_default_device())


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        fill = 0.0 if add_unit_offset else 1.0
        self.weight = new_parameter((hidden_size,), default_weight_loader, fill=fill)
        self.kernels = layer_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps, self.add_unit_offset)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a residual add and the next norm, fused."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps, self.add_unit_offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, add_unit_offset={self.add_unit_offset}"


def unscaled_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalization without a learned scale (Gemma 3n / 4's value norm), in fp32."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)

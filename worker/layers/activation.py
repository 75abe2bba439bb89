"""Gated activations of the MLP: act(gate) * up on the two halves of a merged projection.

SiLU-and-mul runs on the device's layer kernels (`kernels.layer_ops_registry`: one fused Triton
launch on CUDA, two torch calls elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.norm import layer_kernels


class SiluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: silu(gate) * up."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = layer_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: gelu_tanh(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GeluAndMul(nn.Module):
    """[..., 2 * d] -> [..., d]: gelu(gate) * up with the exact (erf) gelu."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate) * up


_GATED: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
    "gelu": GeluAndMul,
}


def gated_activation(name: str) -> nn.Module:
    """The gated activation for a transformers `hidden_act` name."""
    if name not in _GATED:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_GATED)}")
    return _GATED[name]()

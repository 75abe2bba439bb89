"""RMSNorm as transformers computes it: statistics in fp32, then the learned scale.

Llama-style norms multiply by `w` after casting back to the input dtype; Gemma-style norms
multiply the fp32 result by `(1 + w)` and cast last. Both orders are kept for bit-close parity.
A Gemma-style norm folds the offset into its weight when the weight is loaded: the parameter
holds `1 + w` in fp32 (what transformers multiplies by), so no step adds it again; every load
(start-up, reload, in-place update) goes through its `weight_loader`, which folds.
The work runs on the device's layer kernels (`kernels.layer_ops_registry`: one fused Triton
launch on CUDA, the fewest torch calls elsewhere); `add_and_norm` fuses the residual add before
it. `unscaled_rms` normalises without a learned scale.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.layer_ops_registry import LayerKernels, select_layer_kernels
from worker.layers.loading import ShardId, WeightSource, default_weight_loader, new_parameter


def layer_kernels() -> LayerKernels:
    """The layer kernels of the device the model is being built on (the default device)."""
    return select_layer_kernels(torch.get_default_device())


def load_unit_offset_weight(
    param: nn.Parameter, source: WeightSource, shard_id: ShardId = None
) -> None:
    """Loader of a Gemma-style norm: the checkpoint's `w` into the fp32 parameter as `1 + w`,
    `w` first rounded to the model dtype (transformers holds it there and adds 1 in fp32)."""
    default_weight_loader(param, source, shard_id)
    with torch.no_grad():
        rounded = param.data.to(param.model_dtype)  # type: ignore[attr-defined]
        param.data.copy_(rounded.float()).add_(1.0)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, add_unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        if add_unit_offset:  # NOTE: holds 1 + w in fp32 whatever the model dtype (see module)
            self.weight = new_parameter((hidden_size,), load_unit_offset_weight, fill=1.0)
            self.weight.model_dtype = self.weight.dtype  # type: ignore[attr-defined]
            self.weight.data = self.weight.data.float()
        else:
            self.weight = new_parameter((hidden_size,), default_weight_loader, fill=1.0)
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

"""Layer-op registry: the fused Triton kernels of (residual add +) RMSNorm, in-place rotary,
SiLU-and-mul and the output-gated RMSNorm, or their torch versions, picked once per device.

`select_layer_kernels(device)` gives the Triton kernels where Triton runs (CUDA, or CPU under
the interpreter) and the torch versions elsewhere; `prefer_triton=False` keeps the torch
versions. The kernel module loads only when chosen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.registry import triton_device_reason

logger = logging.getLogger(__name__)

RmsNormFn = Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
AddRmsNormFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]
]
RotateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
SiluAndMulFn = Callable[[torch.Tensor], torch.Tensor]
GatedRmsNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class LayerKernels:
    """The elementwise kernels of a decoder layer (signatures of `kernels.layer_ops_reference`)."""

    name: str
    rms_norm: RmsNormFn
    add_rms_norm: AddRmsNormFn
    rotate_in_place: RotateFn
    silu_and_mul: SiluAndMulFn
    gated_rms_norm: GatedRmsNormFn


def select_layer_kernels(device: str | torch.device, prefer_triton: bool = True) -> LayerKernels:
    """Triton kernels where Triton runs on `device` (and `prefer_triton`), else torch's."""
    device = torch.device(device)
    if device.type == "meta" or not prefer_triton or triton_device_reason(device) is not None:
        from kernels import layer_ops_reference as torch_ops

        return LayerKernels(
            "torch",
            torch_ops.rms_norm,
            torch_ops.add_rms_norm,
            torch_ops.rotate_in_place,
            torch_ops.silu_and_mul,
            torch_ops.gated_rms_norm,
        )
    from kernels import triton_layer_ops

    return LayerKernels(
        "triton",
        triton_layer_ops.rms_norm,
        triton_layer_ops.add_rms_norm,
        triton_layer_ops.rotate_in_place,
        triton_layer_ops.silu_and_mul,
        triton_layer_ops.gated_rms_norm,
    )

"""The batch-invariant mode's decoder-layer kernels: the torch SiLU-and-mul and output-gated
RMSNorm with their SiLU on whole vectors (`kernels.batch_invariant.whole_vectors`), so a row's
value does not depend on the tensor's size; the norms and rotary are per row already.

`invariant_layer_kernels(kernels)` is what the mode installs on a layer holding `kernels`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kernels.batch_invariant import whole_vectors
from kernels.layer_ops_reference import _fused_rms_norm
from kernels.layer_ops_registry import LayerKernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`kernels.layer_ops_reference.silu_and_mul` with its SiLU on whole vectors."""
    gate, up = x.chunk(2, dim=-1)
    return whole_vectors(F.silu, gate) * up


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`kernels.layer_ops_reference.gated_rms_norm` with its SiLU on whole vectors."""
    silu = whole_vectors(F.silu, gate.float())
    if x.dtype == weight.dtype == torch.float32:
        return _fused_rms_norm(x, weight, eps) * silu
    scaled = weight * _fused_rms_norm(x, None, eps)
    return (scaled * silu).to(x.dtype)


def invariant_layer_kernels(kernels: LayerKernels) -> LayerKernels:
    """`kernels` with the batch-invariant SiLU kernels where they are torch's (a Triton kernel
    computes each element alone already)."""
    if kernels.name != "torch":
        return kernels
    return dataclasses.replace(
        kernels, name="batch_invariant", silu_and_mul=silu_and_mul, gated_rms_norm=gated_rms_norm
    )

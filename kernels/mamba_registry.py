"""Mamba kernel registry: the torch reference or the Triton kernels, picked once per worker.

`select_mamba_kernels` follows the attention backend choice: "torch" and "reference" give the
reference, "batch_invariant" the token-by-token scan and delta rule of the batch-invariant mode
(`kernels.batch_invariant_recurrent`) with the reference conv, "triton" the Triton kernels
(ValueError when unavailable), "flash_attn" and "auto" the Triton kernels on CUDA when triton
imports, else the reference. Kernel modules load only when chosen. The gated DeltaNet layers'
delta rule kernels come along (`kernels.gated_delta_registry`): fla-core on CUDA when
installed, unless "torch" or "reference" was asked.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.gated_delta_registry import GatedDeltaKernels, select_gated_delta_kernels
from kernels.registry import BACKEND_NAMES, triton_device_reason

logger = logging.getLogger(__name__)

ConvFn = Callable[..., object]
ScanFn = Callable[..., object]


@dataclass(frozen=True)
class MambaKernels:
    """The two kernels a Mamba layer calls (signatures of `kernels.mamba_reference`)."""

    name: str
    causal_conv1d: ConvFn
    ssd_scan: ScanFn
    gated_delta: GatedDeltaKernels
    """Kernels of the gated DeltaNet layers (fla-core on CUDA unless "torch" was asked)."""


def select_mamba_kernels(name: str, device: str | torch.device) -> MambaKernels:
    """Mamba kernels for the attention backend `name` on `device` (see the module docstring)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKEND_NAMES}")
    device = torch.device(device)
    if name == "batch_invariant":
        from kernels import batch_invariant_recurrent as invariant

        return MambaKernels(
            name, invariant.causal_conv1d, invariant.ssd_scan, invariant.gated_delta_kernels()
        )
    if name in ("torch", "reference"):
        return _build("torch", device, allow_fla=False)
    reason = triton_device_reason(device)
    if name == "triton" and reason is not None:
        raise ValueError(f"Triton Mamba kernels are unavailable: {reason}")
    if reason is None:
        logger.info("Mamba kernels: triton on %s", device)
        return _build("triton", device, allow_fla=True)
    logger.info("Mamba kernels: torch (%s)", reason)
    return _build("torch", device, allow_fla=True)


def _build(name: str, device: torch.device, allow_fla: bool) -> MambaKernels:
    gated = select_gated_delta_kernels(device, allow_fla=allow_fla)
    if name == "torch":
        from kernels import mamba_reference

        return MambaKernels(name, mamba_reference.causal_conv1d, mamba_reference.ssd_scan, gated)
    from kernels import triton_mamba

    return MambaKernels(name, triton_mamba.causal_conv1d, triton_mamba.ssd_scan, gated)

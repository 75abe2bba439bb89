"""LoRA kernel registry: the Triton kernels on CUDA, the batched torch path elsewhere.

`select_lora_kernels` is called once per worker; "triton" also runs on CPU under
TRITON_INTERPRET=1 (tests). Kernel modules load only when chosen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.lora_reference import LoRASegments
from kernels.registry import triton_device_reason

logger = logging.getLogger(__name__)

LORA_KERNEL_NAMES = ("auto", "triton", "torch", "reference")


class LoRAShrinkFn(Protocol):
    """`lora_shrink(x, lora_a, segments)`: x @ A[slot]^T per adapted row."""

    def __call__(
        self, x: torch.Tensor, lora_a: torch.Tensor, segments: LoRASegments
    ) -> torch.Tensor: ...


class LoRAExpandFn(Protocol):
    """`lora_expand(out, shrunk, lora_b, segments)`: out + shrunk @ B[slot]^T per adapted row."""

    def __call__(
        self, out: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class LoRAKernels:
    """The two matmuls a `LoRALayer` calls, from one backend."""

    name: str
    shrink: LoRAShrinkFn
    expand: LoRAExpandFn


def select_lora_kernels(name: str, device: str | torch.device) -> LoRAKernels:
    """LoRA kernels `name` (one of `LORA_KERNEL_NAMES`) on `device`; "auto" prefers Triton.
    ValueError naming the reason when "triton" is asked for and cannot run."""
    if name not in LORA_KERNEL_NAMES:
        raise ValueError(f"unknown LoRA kernels {name!r}; choose one of {LORA_KERNEL_NAMES}")
    reason = triton_device_reason(torch.device(device))
    if name == "triton" and reason is not None:
        raise ValueError(f"Triton LoRA kernels are unavailable: {reason}")
    if name == "auto":
        name = "triton" if reason is None else "torch"
        logger.info("LoRA kernels: %s%s", name, f" ({reason})" if reason else "")
    if name == "triton":
        from kernels import triton_lora

        return LoRAKernels(name, triton_lora.lora_shrink, triton_lora.lora_expand)
    if name == "torch":
        from kernels import lora_torch

        return LoRAKernels(name, lora_torch.lora_shrink, lora_torch.lora_expand)
    from kernels import lora_reference

    return LoRAKernels(name, lora_reference.lora_shrink, lora_reference.lora_expand)

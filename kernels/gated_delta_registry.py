"""Gated delta rule kernel choice: fla-core on CUDA when it imports, else the torch reference.

Picked once per worker, with the Mamba kernels (`kernels.mamba_registry`); the reason for a
fallback is logged. The reference is always available and is the CPU path; it brings the fused
decode step of the whole layer (`kernels.gated_delta_decode`), which kernels without one leave
to their own conv and recurrent forms.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DeltaRuleFn = Callable[..., object]
DecodeStepFn = Callable[..., object]


@dataclass(frozen=True)
class GatedDeltaKernels:
    """The two forms of the gated delta rule (signatures of `kernels.gated_delta_reference`)."""

    name: str
    chunked: DeltaRuleFn
    """Prefill form (any sequence lengths)."""
    recurrent: DeltaRuleFn
    """Decode form (meant for one-token sequences)."""
    decode_step: DecodeStepFn | None = None
    """A whole decode step of the layer, conv to output, in one function (signature of
    `kernels.gated_delta_decode.gated_delta_decode_step`); None: conv and `recurrent`."""


def fla_unavailable_reason(device: torch.device) -> str | None:
    """Why fla-core cannot serve `device`, or None when it can."""
    if device.type != "cuda":
        return f"fla-core kernels need a CUDA device, not {device.type}"
    if importlib.util.find_spec("fla") is None:
        return "fla-core is not installed (pip install '.[gpu]')"
    return None


def select_gated_delta_kernels(
    device: str | torch.device, allow_fla: bool = True
) -> GatedDeltaKernels:
    """fla-core on CUDA when installed and `allow_fla`, else the torch reference."""
    reason = fla_unavailable_reason(torch.device(device)) if allow_fla else "torch requested"
    if reason is None:
        from kernels import fla_gated_delta

        logger.info("gated delta rule kernels: fla-core")
        return GatedDeltaKernels(
            "fla", fla_gated_delta.chunked_gated_delta_rule,
            fla_gated_delta.recurrent_gated_delta_rule,
        )  # fmt: skip
    logger.info("gated delta rule kernels: torch (%s)", reason)
    from kernels import gated_delta_decode
    from kernels import gated_delta_reference as ref

    return GatedDeltaKernels(
        "torch", ref.chunked_gated_delta_rule, ref.recurrent_gated_delta_rule,
        gated_delta_decode.gated_delta_decode_step,
    )  # fmt: skip

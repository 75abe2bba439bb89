"""The batch-invariant mode on a built model: each layer's `math` (products against weights,
pointwise functions) and its decoder-layer `kernels` become the mode's invariant versions
(`kernels.batch_invariant`, `kernels.batch_invariant_layers`), so a step runs on them with no
Python dispatch of its own. The worker installs it after loading the model and its drafter.
"""

from __future__ import annotations

from torch import nn

from kernels.batch_invariant import INVARIANT_MATH, LayerMath
from kernels.batch_invariant_layers import invariant_layer_kernels
from kernels.layer_ops_registry import LayerKernels


def install_batch_invariant(model: nn.Module) -> None:
    """Give every layer of `model` the batch-invariant operations (in place)."""
    for module in model.modules():
        if isinstance(getattr(module, "math", None), LayerMath):
            setattr(module, "math", INVARIANT_MATH)  # noqa: B010 (not a declared attribute)
        kernels = getattr(module, "kernels", None)
        if isinstance(kernels, LayerKernels):
            setattr(module, "kernels", invariant_layer_kernels(kernels))  # noqa: B010

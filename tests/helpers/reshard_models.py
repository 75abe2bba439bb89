"""The tiny random hybrids of the KV reshard tests and benchmark, each with a block size at which
one and two tensor-parallel ranks unify to the same hybrid block size (so their prefix caches
key blocks alike): full + sliding attention (its two KV heads split), Mamba-2 with one B/C group
(replicated on both ranks), gated DeltaNet."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import save_tiny_model

RESHARD_FAMILIES: dict[str, tuple[Callable[[Path], torch.nn.Module], int]] = {
    "gemma3": (lambda path: save_tiny_model("gemma3", path), 4),
    "bamba": (lambda path: save_tiny_hybrid("bamba", path), 8),
    "qwen3_5": (lambda path: save_tiny_linear_hybrid("qwen3_5", path), 4),
}
"""Family -> (saver returning the transformers model, block size)."""

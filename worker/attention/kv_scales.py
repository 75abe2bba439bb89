"""fp8 KV scales of the attention layers: read from a checkpoint, computed, or shared.

Checkpoint names (compressed-tensors and vLLM's): `<attention module>.k_scale` / `.v_scale`,
`.k_proj.output_scale` / `.v_proj.output_scale` and `.kv_scale` (both), each one number per
layer; `KV_SCALE_SUFFIXES` is the one place those names are mapped. `read_kv_scales` takes
them out of the weight stream before the parameters load, so a checkpoint without them loads
as before (the scales stay 1.0). `prepare_kv_scales` runs once the caches are bound: a
KV-sharing layer reads its target's scales, and with `calculate_kv_scales` each layer that
stores takes its scales from the first batch it stores.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from worker.attention.attention import Attention
from worker.layers.loading import WeightSource, read_full

logger = logging.getLogger(__name__)

KV_SCALE_SUFFIXES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".k_proj.output_scale", ("k_scale",)),
    (".v_proj.output_scale", ("v_scale",)),
    (".kv_scale", ("k_scale", "v_scale")),
    (".k_scale", ("k_scale",)),
    (".v_scale", ("v_scale",)),
)
"""Checkpoint name suffix -> the scale buffers of the attention layer it sets."""


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(module prefix, scale buffer names) of a checkpoint KV scale; None for other tensors."""
    for suffix, buffers in KV_SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix), buffers
    return None


def read_kv_scales(
    model: nn.Module, weights: Iterable[tuple[str, WeightSource]]
) -> Iterator[tuple[str, WeightSource]]:
    """Every checkpoint tensor but the KV scales, which are copied into the attention layers
    they name (`<prefix>` or `<prefix>.attn`) as they go by."""
    layers = {
        name: module for name, module in model.named_modules() if isinstance(module, Attention)
    }
    for name, source in weights:
        target = kv_scale_target(name)
        if target is None:
            yield name, source
            continue
        prefix, buffers = target
        layer = layers.get(prefix) or layers.get(f"{prefix}.attn")
        if layer is None:
            logger.warning("checkpoint KV scale %s names no attention layer; skipped", name)
            continue
        value = _read_scale(name, source)
        for buffer in buffers:
            getattr(layer, buffer).fill_(value)


def prepare_kv_scales(layers: Sequence[Attention], calculate: bool) -> None:
    """Point each KV-sharing layer at its target's scale buffers (it reads the target's pages),
    and with `calculate` have every storing layer compute its scales from its first batch."""
    by_name = {layer.layer_name: layer for layer in layers}
    for layer in layers:
        target = layer.config.kv_sharing_target
        if target is not None:
            layer.k_scale = by_name[target].k_scale
            layer.v_scale = by_name[target].v_scale
        layer.calculates_kv_scales = calculate and target is None


def _read_scale(name: str, source: WeightSource) -> float:
    """The one positive, finite number a KV scale tensor holds; ValueError naming it else."""
    read_all = getattr(source, "read_all", None)
    if isinstance(source, torch.Tensor):
        tensor = source
    elif len(source.shape) == 0 and read_all is not None:
        tensor = read_all()
    else:
        tensor = read_full(source)
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint KV scale {name} has shape {tuple(tensor.shape)}: fp8 KV caches take "
            "one scale per layer"
        )
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint KV scale {name} is {value}; a scale must be positive")
    return value

"""Checkpoints for weight-update tests: a perturbed copy of a tiny checkpoint (the "trained"
weights), its tensors under their checkpoint names, and a full update through an engine's calls."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from cluster.engine.weight_transfer import local_rank_shards, shapes_of
from worker.weights import checkpoint_files


def perturbed_checkpoint(source: Path, target: Path, seed: int, scale: float = 0.2) -> Path:
    """A copy of checkpoint `source` at `target` whose floating-point tensors are scaled by
    (1 + scale * noise): other weights, same names, shapes and config."""
    shutil.copytree(source, target)
    generator = torch.Generator().manual_seed(seed)
    for path in checkpoint_files(target):
        tensors = load_file(str(path))
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and tensor.numel() > 1:
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
                tensors[name] = (tensor.float() * (1 + scale * noise)).to(tensor.dtype)
        save_file(tensors, str(path), metadata={"format": "pt"})
    return target


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder under its checkpoint name (a trainer's state dict)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        tensors.update(load_file(str(path)))
    return tensors


def push_in_memory(llm: Any, tensors: dict[str, torch.Tensor], version: object = None) -> str:
    """One update of an in-process engine: plan, stage every rank's shard, finish."""
    plans = llm.weight_shard_plans(shapes_of(tensors))
    llm.start_weight_update()
    llm.update_weights({"shards": local_rank_shards(tensors, plans)})
    new_version: str = llm.finish_weight_update(version)
    return new_version

"""The layouts that say how tensor parallelism cuts each cache tensor: rebuilding a tensor from
its rank pieces and cutting it again, and, on tiny random models loaded at one and two ranks,
each layer's layouts cut its state channels and heads exactly as the layer cuts the weights
that write them (conv weights, per-head parameters, key projection rows)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import save_tiny_model
from worker.attention.attention import Attention
from worker.config import ModelConfig, ParallelConfig
from worker.kv_io.cache_shard_layout import CachePart, CacheShardLayout
from worker.models.registry import get_model_class
from worker.state.gated_delta_net import GatedDeltaNet
from worker.state.mamba import MambaMixer2
from worker.state.short_conv import ShortConv
from worker.weights import iterate_weights

MAMBA_CONV = CacheShardLayout(-2, (CachePart(4, 3), CachePart(1, 2), CachePart(1, 2)))
"""x of 4 heads of 3 channels, then B and C of one group of 2 (replicated on every rank)."""


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_pieces_rebuild_the_whole_tensor(tp_size: int) -> None:
    whole = torch.arange(2 * 16 * 5, dtype=torch.float32).view(2, 16, 5)
    pieces = [MAMBA_CONV.cut(whole, tp_size, rank) for rank in range(tp_size)]
    assert all(piece.shape == (2, 12 // tp_size + 4, 5) for piece in pieces)
    assert all(torch.equal(piece[:, -4:], whole[:, -4:]) for piece in pieces)  # B, C replicated
    assert torch.equal(MAMBA_CONV.gather(pieces), whole)
    other = 2 if tp_size != 2 else 1
    moved = [MAMBA_CONV.cut(MAMBA_CONV.gather(pieces), other, r) for r in range(other)]
    assert torch.equal(MAMBA_CONV.gather(moved), whole)


def test_heads_fewer_than_ranks_are_replicated_and_uneven_cuts_refused() -> None:
    heads = CacheShardLayout(-2, (CachePart(2),))
    whole = torch.randn(3, 4, 2, 8)  # [rows, block, heads, head_size]
    pieces = [heads.cut(whole, 4, rank) for rank in range(4)]
    assert all(torch.equal(p, whole[:, :, r // 2 : r // 2 + 1]) for r, p in enumerate(pieces))
    assert torch.equal(heads.gather(pieces), whole)
    with pytest.raises(ValueError, match="3 units cannot be split over, nor replicated on"):
        CacheShardLayout(-2, (CachePart(3),)).cut(torch.randn(1, 3, 1), 2, 0)
    with pytest.raises(ValueError, match="pieces of"):
        heads.gather([whole, whole])


def _layers(path: Path, tp_size: int, rank: int) -> dict[str, nn.Module]:
    """Layers (by layer name) of the checkpoint at `path`, loaded as rank `rank` of `tp_size`."""
    config = ModelConfig.from_pretrained(path, dtype="float32")
    model = get_model_class(config.architecture)(config, ParallelConfig(tp_size, rank))
    model.load_weights(iterate_weights(path))
    return dict(_cache_owners(model))


def _cache_owners(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for module in model.modules():
        if isinstance(module, (MambaMixer2, GatedDeltaNet, ShortConv)):
            yield module.layer_name, module
        elif hasattr(module, "qkv_proj") and isinstance(getattr(module, "attn", None), Attention):
            yield module.attn.layer_name, module


def _written_by(module: nn.Module) -> list[torch.Tensor]:
    """Per cache tensor, a weight whose channels / heads (at the layout's dim) it writes."""
    if isinstance(module, (MambaMixer2, GatedDeltaNet)):
        conv = (module.conv1d.weight[:, 0],)  # [channels, width]
        return [*conv, module.A_log.view(-1, 1, 1)]  # heads at dim -3, as the state's
    if isinstance(module, ShortConv):
        return [module.conv.weight[:, 0]]
    qkv, attn = module.qkv_proj, module.attn.config
    start, size = qkv.shards["k"].param_start, qkv.shards["k"].size  # this rank's key rows
    keys = qkv.weight[start : start + size].reshape(attn.num_kv_heads, attn.head_size, -1)
    return [keys, keys]  # [heads, head_size, hidden]: heads at dim -3


def _layouts(module: nn.Module) -> tuple[CacheShardLayout, ...]:
    layouts = (module.attn if hasattr(module, "attn") else module).cache_shard_layouts()
    assert layouts is not None
    if hasattr(module, "attn"):  # the cache is [.., heads, head_size], the key rows one dim out
        return tuple(replace(layout, dim=layout.dim - 1) for layout in layouts)
    return layouts


SAVERS: dict[str, Callable[[Path], object]] = {
    "gemma3_one_kv_head": lambda path: save_tiny_model("gemma3", path, num_key_value_heads=1),
    "bamba_one_group": lambda path: save_tiny_hybrid("bamba", path),
    "bamba_two_groups": lambda path: save_tiny_hybrid("bamba", path, mamba_n_groups=2),
    "qwen3_5": lambda path: save_tiny_linear_hybrid("qwen3_5", path),
    "lfm2": lambda path: save_tiny_linear_hybrid("lfm2", path),
}


@pytest.mark.parametrize("family", list(SAVERS))
def test_layouts_cut_caches_as_the_layers_cut_their_weights(family: str, tmp_path: Path) -> None:
    SAVERS[family](tmp_path)
    whole = _layers(tmp_path, 1, 0)
    ranks = [_layers(tmp_path, 2, rank) for rank in range(2)]
    assert whole.keys() == ranks[0].keys()
    for name, module in whole.items():
        for index, layout in enumerate(_layouts(module)):
            full = _written_by(module)[index]
            pieces = [_written_by(layers[name])[index] for layers in ranks]
            for rank, piece in enumerate(pieces):
                assert torch.equal(layout.cut(full, 2, rank), piece), (name, index, rank)
            assert torch.equal(layout.gather(pieces), full), (name, index)

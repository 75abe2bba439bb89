"""Tensor-parallel splits of the gated DeltaNet (fused Qwen3-Next and separate Qwen3.5
projections) and short-conv layers: each rank's projections are its heads' (or channels')
slice of the whole layer's, and its state spec is its share."""

from __future__ import annotations

import pytest
import torch

from scheduler.kv_cache.spec import MambaCacheMode
from tests.helpers.tiny_linear_hybrid import build_tiny_linear_hybrid
from worker.config import ParallelConfig
from worker.layers.loading import read_part
from worker.models.qwen3_next import delta_net_config
from worker.models.qwen_next_moe import split_stacked_experts
from worker.state.gated_delta_net import GatedDeltaNet
from worker.state.short_conv import ShortConv, ShortConvConfig
from worker.weights import load_named_weights

KEY_HEADS, VALUE_HEADS, DK, DV = 2, 4, 8, 8  # tests.helpers.tiny_linear_hybrid's sizes


def _layer_weights(family: str, prefix: str) -> dict[str, torch.Tensor]:
    state = build_tiny_linear_hybrid(family).state_dict()
    return {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}


def _ranks(layer_of: object, weights: dict[str, torch.Tensor], tp: int) -> list[torch.nn.Module]:
    layers = []
    for rank in range(tp):
        layer = layer_of(ParallelConfig(tp_size=tp, rank=rank))  # type: ignore[operator]
        loaded = load_named_weights(layer, weights.items())
        assert loaded == {name for name, _ in layer.named_parameters()}
        layers.append(layer)
    return layers


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_each_rank_projects_its_own_key_and_value_heads(family: str) -> None:
    weights = _layer_weights(family, "model.layers.0.linear_attn.")
    hf_config = build_tiny_linear_hybrid(family).config
    cfg = delta_net_config(hf_config, 0, fused=family == "qwen3_next")
    (whole,) = _ranks(lambda p: GatedDeltaNet(cfg, p), weights, 1)
    halves = _ranks(lambda p: GatedDeltaNet(cfg, p), weights, 2)
    hidden = torch.randn(5, hf_config.hidden_size)
    mixed, z, b, a = whole._project(hidden)
    q, k, v = mixed.split([KEY_HEADS * DK, KEY_HEADS * DK, VALUE_HEADS * DV], dim=-1)
    for rank, half in enumerate(halves):
        keys, values = slice(rank * DK, (rank + 1) * DK), slice(rank * 2 * DV, (rank + 1) * 2 * DV)
        heads = slice(rank * 2, rank * 2 + 2)
        got_mixed, got_z, got_b, got_a = half._project(hidden)
        want = torch.cat([q[:, keys], k[:, keys], v[:, values]], dim=-1)
        torch.testing.assert_close(got_mixed, want)
        torch.testing.assert_close(got_z, z[:, heads])
        torch.testing.assert_close(got_b, b[:, heads])
        torch.testing.assert_close(got_a, a[:, heads])
        torch.testing.assert_close(half.A_log, whole.A_log[heads])
        spec = half.kv_cache_spec(4, 4, MambaCacheMode.ALIGN)
        assert spec.shapes == ((2 * DK + 2 * DV, 3), (2, DK, DV))


def test_short_conv_ranks_hold_their_channels_of_b_c_x() -> None:
    weights = _layer_weights("lfm2", "model.layers.0.conv.")
    cfg = ShortConvConfig("model.layers.0.conv", hidden_size=64, conv_width=3, bias=False)
    (whole,) = _ranks(lambda p: ShortConv(cfg, p), weights, 1)
    halves = _ranks(lambda p: ShortConv(cfg, p), weights, 2)
    hidden = torch.randn(5, 64)
    b, c, x = (hidden @ whole.in_proj.weight.T).chunk(3, dim=-1)
    for rank, half in enumerate(halves):
        channels = slice(rank * 32, (rank + 1) * 32)
        got_b, got_c, got_x = (hidden @ half.in_proj.weight.T).chunk(3, dim=-1)
        torch.testing.assert_close(got_b, b[:, channels])
        torch.testing.assert_close(got_c, c[:, channels])
        torch.testing.assert_close(got_x, x[:, channels])
        torch.testing.assert_close(half.conv.weight, whole.conv.weight[channels])
        assert half.kv_cache_spec(4, 4, MambaCacheMode.ALL).shapes == ((32, 2),)


def test_stacked_experts_split_into_per_expert_gate_up_and_down() -> None:
    gate_up = torch.randn(3, 8, 5)  # [E, 2I, H]
    down = torch.randn(3, 5, 4)  # [E, H, I]
    other = torch.randn(2)
    named = dict(
        split_stacked_experts(
            [("m.mlp.experts.gate_up_proj", gate_up), ("m.mlp.experts.down_proj", down),
             ("m.norm.weight", other)]
        )
    )  # fmt: skip
    assert named["m.norm.weight"] is other
    part = named["m.mlp.experts.2.up_proj.weight"]
    assert tuple(part.shape) == (4, 5)
    torch.testing.assert_close(read_part(part, 0, 2, 2), gate_up[2, 6:8])  # rank 1 of 2
    torch.testing.assert_close(
        read_part(named["m.mlp.experts.1.gate_proj.weight"], 0, 0, 4), gate_up[1, :4]
    )
    torch.testing.assert_close(
        read_part(named["m.mlp.experts.0.down_proj.weight"], 1, 2, 2), down[0, :, 2:]
    )
    assert len(named) == 1 + 3 * 3

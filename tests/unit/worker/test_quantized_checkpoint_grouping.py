"""How a quantized checkpoint's tensors reach the model: parts grouped across shards into one
dequantized source under the unquantized name, everything else passed through, and a
quantized tensor whose scales are missing refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from worker.layers.loading import read_full
from worker.weights import iterate_weights

BLOCK = 4


def _write_sharded(folder: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    weight_map = {}
    for index, tensors in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    quant = {"quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))


def _fp8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantized `weight`: e4m3 values and one float32 scale per BLOCK x BLOCK block."""
    rows, cols = -(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK)
    scales = torch.rand(rows, cols) + 0.5
    full = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    full = full[: weight.shape[0], : weight.shape[1]]
    return (weight / full).to(torch.float8_e4m3fn), scales


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor as the model gets it (a source is valid until the next one is asked for)."""
    return {name: read_full(source) for name, source in iterate_weights(folder)}


def test_parts_in_other_shards_are_grouped_and_plain_tensors_pass(tmp_path: Path) -> None:
    weight = torch.randn(6, 10)
    values, scales = _fp8_parts(weight)
    norm = torch.randn(10)
    _write_sharded(
        tmp_path,
        [{"layer.weight_scale_inv": scales, "norm.weight": norm}, {"layer.weight": values}],
    )
    loaded = _read_all(tmp_path)
    assert sorted(loaded) == ["layer.weight", "norm.weight"]
    full = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:6, :10]
    expected = values.to(torch.float32) * full
    assert torch.equal(loaded["layer.weight"], expected)
    assert torch.equal(loaded["norm.weight"], norm)


def test_an_fp8_weight_without_its_scale_is_refused_by_name(tmp_path: Path) -> None:
    values, _ = _fp8_parts(torch.randn(4, 4))
    _write_sharded(tmp_path, [{"layer.weight": values}])
    with pytest.raises(ValueError, match=r"layer\.weight is F8_E4M3 but has no weight_scale_inv"):
        list(iterate_weights(tmp_path))


def test_misshapen_block_scales_are_refused_by_name(tmp_path: Path) -> None:
    values, _ = _fp8_parts(torch.randn(8, 8))
    _write_sharded(tmp_path, [{"layer.weight": values, "layer.weight_scale_inv": torch.ones(3, 2)}])
    with pytest.raises(ValueError, match=r"layer\.weight_scale_inv has shape \(3, 2\), expected"):
        _read_all(tmp_path)

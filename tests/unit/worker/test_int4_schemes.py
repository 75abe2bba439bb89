"""Int4 checkpoint tensors read through `iterate_weights`: each quantized layer arrives once,
under its unquantized name, equal to the independent reference dequantization of its parts;
plain tensors pass untouched; unsupported variants and broken parts are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.quantized_int4_checkpoints import (
    Int4Format,
    nibbles,
    pack_columns,
    reference_weights,
    write_int4_checkpoint,
)
from worker.quantization.schemes import scheme_for
from worker.weights import iterate_weights

SHAPES = {
    "model.layers.0.self_attn.q_proj.weight": (48, 256),
    "model.layers.0.mlp.down_proj.weight": (64, 128),
}
PLAIN = {"model.norm.weight": (256,), "lm_head.weight": (40, 256)}
FORMATS = [
    Int4Format("awq", 32),
    Int4Format("awq", 128),
    Int4Format("awq", -1),
    Int4Format("gptq", 32, symmetric=True),
    Int4Format("gptq", 128, act_order=True),
    Int4Format("gptq", 32, symmetric=True, act_order=True),
    Int4Format("gptq", -1),
    Int4Format("compressed-tensors", 32),
    Int4Format("compressed-tensors", 128, symmetric=True),
    Int4Format("compressed-tensors", 32, act_order=True),
    Int4Format("compressed-tensors", -1),
]
PADDED = {"model.layers.0.mlp.up_proj.weight": (36, 100)}
"""compressed-tensors packs any shape: rows of 100 codes end in a padded int32, and the zero
points of 36 rows (packed along them) too."""


def _plain_folder(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    generator = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    path.mkdir(parents=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    return {name: source.narrow(0, 0, source.shape[0]) for name, source in iterate_weights(folder)}


def _quantized(tmp_path: Path, fmt: Int4Format) -> Path:
    padded = PADDED if fmt.method == "compressed-tensors" else {}
    plain = _plain_folder(tmp_path / "plain", {**SHAPES, **padded, **PLAIN})
    return write_int4_checkpoint(plain, tmp_path / "int4", fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=[fmt.label for fmt in FORMATS])
def test_each_layer_is_its_reference_dequantization(tmp_path: Path, fmt: Int4Format) -> None:
    folder = _quantized(tmp_path, fmt)
    loaded = _loaded(folder)
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert loaded.keys() == plain.keys()
    expected_weights = reference_weights(folder, fmt)
    assert expected_weights.keys() == plain.keys() - PLAIN.keys()
    for name, expected in expected_weights.items():
        assert torch.equal(loaded[name], expected), name
        assert (loaded[name] - plain[name]).abs().max() < 0.35 * plain[name].abs().max(), name
    for name in PLAIN:
        assert torch.equal(loaded[name], plain[name])


def test_gptq_v2_zero_points_are_stored_as_they_are(tmp_path: Path) -> None:
    fmt = Int4Format("gptq", 32)
    folder = _quantized(tmp_path, fmt)
    expected = reference_weights(folder, fmt)
    tensors = load_file(str(folder / "model.safetensors"))
    for name, qzeros in list(tensors.items()):
        if name.endswith(".qzeros"):
            tensors[name] = pack_columns(nibbles(qzeros).flatten(1) + 1)
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (folder / "config.json").write_text(json.dumps(config))
    loaded = _loaded(folder)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def _ct(weights: dict[str, Any]) -> dict[str, Any]:
    """A compressed-tensors pack-quantized config with one group of `weights`."""
    group = {"targets": ["Linear"], "weights": weights}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": group},
    }


UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
        "awq version 'gemv'",
    ),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, "awq version"),
    (
        {"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"},
        "awq checkpoints with bits=8",
    ),
    (
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
        "awq checkpoints without zero",
    ),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq checkpoints with bits=3"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "gptq checkpoints with bits=8"),
    (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
        "gptq checkpoint_format 'marlin'",
    ),
    (
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True},
        "marlin format",
    ),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "invalid group_size 0"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    (_ct({"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}), "W8A16 int8"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "tensor"}), "strategy 'tensor'"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group"}), "strategy group needs"),
    (
        _ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "dynamic": True}),
        "dynamic",
    ),
]


@pytest.mark.parametrize(("config", "message"), UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_variants_are_one_line_errors(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        scheme_for(config, "/models/x")
    assert "\n" not in str(info.value)


def _break(folder: Path, edit: Any) -> str:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"^quantized checkpoint tensor ") as info:
        _loaded(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_broken_parts_are_one_line_errors_naming_the_tensor(tmp_path: Path) -> None:
    folder = _quantized(tmp_path, Int4Format("gptq", 32, act_order=True))
    q_proj = "model.layers.0.self_attn.q_proj"
    message = _break(folder, lambda tensors: tensors.pop(f"{q_proj}.qzeros"))
    assert f"{q_proj}.weight has no qzeros" in message
    folder = _quantized(tmp_path / "again", Int4Format("gptq", 32, act_order=True))
    message = _break(
        folder,
        lambda tensors: tensors.update({f"{q_proj}.g_idx": torch.zeros(5, dtype=torch.int32)}),
    )
    assert f"{q_proj}.weight g_idx has shape (5,)" in message
    folder = _quantized(tmp_path / "third", Int4Format("awq", 32))
    message = _break(
        folder,
        lambda tensors: tensors.update(
            {f"{q_proj}.scales": tensors[f"{q_proj}.scales"][:, :40].contiguous()}
        ),
    )
    assert f"{q_proj}.weight scales has shape (40, 8), expected (48, 8)" in message

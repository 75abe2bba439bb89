"""MXFP4 and compressed-tensors FP8 tensors as the loader hands them to the model, against the
independent reference dequantizers: every e2m1 code in both nibbles over a range of
exponents, block scales over partial blocks, and each tensor read by the config group that
targets its module."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.quantized_checkpoints import compressed_fp8_config, reference_weights
from worker.layers.loading import read_full
from worker.weights import iterate_weights


def _write(folder: Path, tensors: dict[str, torch.Tensor], quant: dict[str, Any]) -> None:
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": quant}))


def _loaded(folder: Path) -> dict[str, torch.Tensor]:
    return {name: read_full(source) for name, source in iterate_weights(folder)}


def test_mxfp4_every_code_and_exponent_matches_the_reference(tmp_path: Path) -> None:
    experts, rows, cols = 2, 16, 64  # every byte value 0..255 in each expert's blocks
    blocks = torch.arange(experts * rows * cols // 2).remainder(256).to(torch.uint8)
    scales = torch.randint(110, 140, (experts, rows, cols // 32), dtype=torch.uint8)
    name = "model.layers.0.mlp.experts.down_proj"
    _write(
        tmp_path,
        {f"{name}_blocks": blocks.reshape(experts, rows, cols // 32, 16), f"{name}_scales": scales},
        {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
    )
    loaded = _loaded(tmp_path)
    assert list(loaded) == [name]
    assert loaded[name].shape == (experts, cols, rows)  # [E, K, N]: inputs first
    assert torch.equal(loaded[name], reference_weights(tmp_path)[name])


def _block_reference(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    full = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return weight.float() * full[: weight.shape[0], : weight.shape[1]]


def test_compressed_tensors_fp8_block_scales_over_partial_blocks(tmp_path: Path) -> None:
    weight = torch.randn(200, 300).to(torch.float8_e4m3fn)  # 2 x 3 blocks, the last partial
    scale = torch.rand(2, 3, dtype=torch.bfloat16) + 0.5
    quant = compressed_fp8_config("block", ["lm_head"])
    quant["config_groups"]["group_0"]["weights"]["block_structure"] = [128, 128]
    _write(tmp_path, {"proj.weight": weight, "proj.weight_scale": scale}, quant)
    assert torch.equal(_loaded(tmp_path)["proj.weight"], _block_reference(weight, scale, 128))


def test_each_tensor_is_read_by_the_group_that_targets_its_module(tmp_path: Path) -> None:
    """A `re:` target names the MLP (per channel) before the `Linear` class (per tensor)."""
    channel = compressed_fp8_config("channel", [])["config_groups"]["group_0"]
    tensor = compressed_fp8_config("tensor", [])["config_groups"]["group_0"]
    quant = compressed_fp8_config("tensor", ["lm_head"])
    quant["config_groups"] = {
        "attention": tensor,
        "mlp": {**channel, "targets": ["re:.*mlp\\..*_proj$"]},
    }
    mlp, attention = torch.randn(6, 8), torch.randn(4, 8)
    mlp_scale, attention_scale = torch.rand(6, 1) + 0.5, torch.tensor([0.7])
    tensors = {
        "layers.0.mlp.up_proj.weight": mlp.to(torch.float8_e4m3fn),
        "layers.0.mlp.up_proj.weight_scale": mlp_scale,
        "layers.0.self_attn.q_proj.weight": attention.to(torch.float8_e4m3fn),
        "layers.0.self_attn.q_proj.weight_scale": attention_scale,
        "layers.0.self_attn.q_proj.input_scale": torch.tensor([0.1]),
    }
    _write(tmp_path, tensors, quant)
    loaded = _loaded(tmp_path)
    assert sorted(loaded) == ["layers.0.mlp.up_proj.weight", "layers.0.self_attn.q_proj.weight"]
    assert torch.equal(
        loaded["layers.0.mlp.up_proj.weight"],
        reference_weights(tmp_path)["layers.0.mlp.up_proj.weight"],
    )
    expected = reference_weights(tmp_path)["layers.0.self_attn.q_proj.weight"]
    assert torch.equal(loaded["layers.0.self_attn.q_proj.weight"], expected)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"format": "marlin-24"}, r"scheme 2:4 sparse W8A8 float8 \(marlin-24, channel\)"),
        ({"config_groups": {}}, r"compressed-tensors quantization_config has no config_groups"),
    ],
)
def test_unreadable_compressed_tensors_configs_are_refused(
    tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    quant = {**compressed_fp8_config("channel", ["lm_head"]), **edit}
    _write(tmp_path, {"norm.weight": torch.ones(4)}, quant)
    with pytest.raises(ValueError, match=message):
        list(iterate_weights(tmp_path))

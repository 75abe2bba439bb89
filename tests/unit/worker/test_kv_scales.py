"""fp8 KV scales of the attention layers: checkpoint names, loading, sharing layers, calculation.

A tiny Llama saved by transformers gets KV scale tensors added under each name form that
checkpoints use; the real loader (with its completeness check) must put them in the layers'
buffers, and load a checkpoint without them as before (scales 1.0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.kv_quant import fp8_max
from tests.helpers.tiny_models import save_tiny_model
from worker.attention.attention import Attention, AttentionConfig
from worker.attention.kv_scales import kv_scale_target, prepare_kv_scales
from worker.config import ModelConfig, ParallelConfig
from worker.model_loader import load_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    return path


def _with_tensors(source: Path, target: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint at `source` in `target` with `extra` tensors added."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    save_file({**tensors, **extra}, str(target / "model.safetensors"))
    return target


def _load(path: Path) -> torch.nn.Module:
    return load_model(ModelConfig.from_pretrained(path, dtype="float32"), ParallelConfig(), "cpu")


def _scales(model: torch.nn.Module) -> list[tuple[float, float]]:
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    return [(float(layer.k_scale), float(layer.v_scale)) for layer in layers]


def test_checkpoint_names_map_to_the_layer_buffers() -> None:
    prefix = "model.layers.3.self_attn"
    assert kv_scale_target(f"{prefix}.k_scale") == (prefix, ("k_scale",))
    assert kv_scale_target(f"{prefix}.attn.v_scale") == (f"{prefix}.attn", ("v_scale",))
    assert kv_scale_target(f"{prefix}.kv_scale") == (prefix, ("k_scale", "v_scale"))
    assert kv_scale_target(f"{prefix}.k_proj.output_scale") == (prefix, ("k_scale",))
    assert kv_scale_target(f"{prefix}.v_proj.output_scale") == (prefix, ("v_scale",))
    assert kv_scale_target(f"{prefix}.k_proj.weight_scale") is None
    assert kv_scale_target(f"{prefix}.k_proj.input_scale") is None


def test_a_checkpoint_without_scales_loads_with_unit_scales_as_buffers(llama_dir: Path) -> None:
    model = _load(llama_dir)
    assert _scales(model) == [(1.0, 1.0)] * len(_scales(model))
    assert not any(name.endswith(("k_scale", "v_scale")) for name, _ in model.named_parameters())


def test_checkpoint_scales_load_under_every_name_form(llama_dir: Path, tmp_path: Path) -> None:
    extra = {
        "model.layers.0.self_attn.k_proj.output_scale": torch.tensor([0.5]),
        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.25),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.125, dtype=torch.bfloat16),
    }
    model = _load(_with_tensors(llama_dir, tmp_path / "scaled", extra))
    scales = _scales(model)
    assert scales == [(0.5, 0.25), (0.125, 0.125)] + [(1.0, 1.0)] * (len(scales) - 2)
    extra = {"model.layers.1.self_attn.k_scale": torch.tensor(2.0)}
    model = _load(_with_tensors(llama_dir, tmp_path / "k_only", extra))
    assert _scales(model)[:3] == [(1.0, 1.0), (2.0, 1.0), (1.0, 1.0)]


@pytest.mark.parametrize(
    ("scale", "error"),
    [(torch.tensor([0.5, 0.25]), "one scale per layer"), (torch.tensor(0.0), "must be positive")],
)
def test_unusable_checkpoint_scales_are_refused_by_name(
    llama_dir: Path, tmp_path: Path, scale: torch.Tensor, error: str
) -> None:
    bad = _with_tensors(llama_dir, tmp_path / "bad", {"model.layers.0.self_attn.v_scale": scale})
    with pytest.raises(ValueError, match=rf"model\.layers\.0\.self_attn\.v_scale .*{error}"):
        _load(bad)


def _layer(name: str, target: str | None = None, keys_from_values: bool = False) -> Attention:
    config = AttentionConfig(
        name, 4, 2, 16, 0.25, kv_sharing_target=target, keys_from_values=keys_from_values
    )
    return Attention(config)


def test_sharing_layers_read_their_targets_scales_and_only_storing_layers_calculate() -> None:
    owner, sharer = _layer("a"), _layer("b", target="a")
    owner.k_scale.fill_(0.5)
    prepare_kv_scales([owner, sharer], calculate=True)
    assert (owner.calculates_kv_scales, sharer.calculates_kv_scales) == (True, False)
    assert sharer.kv_scales == (owner.k_scale, owner.v_scale)
    owner.v_scale.fill_(0.125)  # e.g. computed from the owner's first batch, in place
    assert float(sharer.v_scale) == 0.125
    prepare_kv_scales([owner, sharer], calculate=False)
    assert not owner.calculates_kv_scales


def test_calculated_scales_map_the_first_batch_amax_onto_the_fp8_maximum() -> None:
    layer = _layer("a")
    key = torch.zeros(3, 2, 16)
    key[1, 0, 5] = -8.96
    value = torch.zeros(3, 2, 16)  # all zeros: the scale stays 1, never 0
    layer.calculates_kv_scales = True
    layer._calculate_kv_scales(key, value, torch.float8_e4m3fn)
    assert float(layer.k_scale) == pytest.approx(8.96 / fp8_max(torch.float8_e4m3fn))
    assert float(layer.v_scale) == 1.0
    assert not layer.calculates_kv_scales


def test_keys_from_values_layers_use_the_value_scale_for_both() -> None:
    layer = _layer("a", keys_from_values=True)
    layer.k_scale.fill_(4.0)
    layer.v_scale.fill_(0.5)
    assert [float(scale) for scale in layer.kv_scales] == [0.5, 0.5]

"""Checkpoint reading and routing: sharded == single file, name mapping, config parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import save_tiny_model
from worker.config import ModelConfig, ParallelConfig, resolve_dtype
from worker.model_loader import load_model
from worker.models.registry import get_model_class, supported_architectures
from worker.weights import checkpoint_files, iterate_weights


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    hf_model = save_tiny_model("qwen2", tmp_path / "single")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    files = checkpoint_files(tmp_path / "sharded")
    assert len(files) > 3
    assert all(path.suffix == ".safetensors" for path in files)
    names_single = {name for name, _ in iterate_weights(tmp_path / "single")}
    names_sharded = {name for name, _ in iterate_weights(tmp_path / "sharded")}
    assert names_single == names_sharded
    models = [
        load_model(
            ModelConfig.from_pretrained(tmp_path / sub, dtype="float32"), ParallelConfig(), "cpu"
        )
        for sub in ("single", "sharded")
    ]
    single, sharded = (_state(model) for model in models)
    assert single.keys() == sharded.keys()
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name


def test_hf_names_route_to_packed_parameters(tmp_path: Path) -> None:
    hf_model = save_tiny_model("mistral", tmp_path)
    model = load_model(
        ModelConfig.from_pretrained(tmp_path, dtype="float32"), ParallelConfig(), "cpu"
    )
    hf = dict(hf_model.named_parameters())
    ours = dict(model.named_parameters())
    expected_qkv = torch.cat([hf[f"model.layers.2.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(ours["model.layers.2.self_attn.qkv_proj.weight"], expected_qkv)
    expected_gate_up = torch.cat(
        [hf[f"model.layers.1.mlp.{p}_proj.weight"] for p in ("gate", "up")]
    )
    assert torch.equal(ours["model.layers.1.mlp.gate_up_proj.weight"], expected_gate_up)
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])


def test_tied_embeddings_share_one_parameter(tmp_path: Path) -> None:
    save_tiny_model("llama", tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(
        ModelConfig.from_pretrained(tmp_path, dtype="float32"), ParallelConfig(), "cpu"
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_incomplete_checkpoint_is_rejected(tmp_path: Path) -> None:
    save_tiny_model("mistral", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = ModelConfig.from_pretrained(tmp_path, dtype="float32")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(config, ParallelConfig(), "cpu")


def test_model_config_reads_the_folder(tmp_path: Path) -> None:
    save_tiny_model("gemma3", tmp_path, eos_token_id=1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    config = ModelConfig.from_pretrained(tmp_path, max_model_len=64, device_type="cpu")
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.dtype == torch.float32
    assert config.dtype_bytes == 4
    assert config.max_model_len == 64
    assert config.vocab_size == 256
    assert config.eos_token_ids == (1, 106)
    assert config.tokenizer_path == str(tmp_path)
    with pytest.raises(ValueError, match="max_position_embeddings=128"):
        ModelConfig.from_pretrained(tmp_path, max_model_len=129)
    with pytest.raises(ValueError, match="is not a folder"):
        ModelConfig.from_pretrained(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        ModelConfig.from_pretrained(tmp_path / "empty")


def test_auto_dtype_is_fp32_on_cpu_and_16_bit_on_gpu() -> None:
    assert resolve_dtype("auto", torch.bfloat16, "cpu") == torch.float32
    assert resolve_dtype("auto", torch.bfloat16, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", torch.float16, "cuda") == torch.float16
    assert resolve_dtype("auto", torch.float32, "cuda") == torch.bfloat16
    assert resolve_dtype("bf16", None, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", None, "cpu")


def test_registry_lists_supported_architectures() -> None:
    assert get_model_class("MistralForCausalLM").__name__ == "MistralForCausalLM"
    with pytest.raises(ValueError, match="LlamaForCausalLM") as excinfo:
        get_model_class("GPT2LMHeadModel")
    assert "GPT2LMHeadModel" in str(excinfo.value)
    assert set(supported_architectures()) >= {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
    }


def test_dummy_load_format_needs_only_the_config(tmp_path: Path) -> None:
    """`load_format="dummy"` builds the model from config.json alone, every parameter small and
    random; the default format refuses a folder without weights."""
    save_tiny_model("llama", tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    config = ModelConfig.from_pretrained(tmp_path)
    model = load_model(config, ParallelConfig(), "cpu", load_format="dummy")
    for name, param in model.named_parameters():
        assert param.abs().max() <= 1e-3, name
        assert param.std() > 1e-4, name
    with pytest.raises(ValueError, match="safetensors"):
        load_model(config, ParallelConfig(), "cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(config, ParallelConfig(), "cpu", load_format="npz")


def test_dummy_gemma_norms_scale_near_one(tmp_path: Path) -> None:
    """A Gemma-style norm holds `1 + w`: its dummy weights are the folded U(-1e-3, 1e-3), near 1
    (as a checkpoint of such values would load), so dummy activations keep their size."""
    save_tiny_model("gemma3", tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    model = load_model(config, ParallelConfig(), "cpu", load_format="dummy")
    norms = [(n, p) for n, p in model.named_parameters() if "norm" in n]
    assert norms
    for name, param in norms:
        assert (param - 1).abs().max() <= 1e-3, name

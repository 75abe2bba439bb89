"""Quantized weights kept for the kernels: each tensor-parallel rank's quantized parts are the
parts of that rank's dequantized weight, and the path is chosen as documented.

Every rank of a two-rank layout is loaded twice on CPU (nothing runs, so no interpreter):
`quantized_weight_mode="dequantize"` (today's per-rank split of the dequantized weight) and
"kernels"; each layer that kept its weights quantized must dequantize (kernel layout ->
`kernels.quant_reference`) to exactly the first one's parameter. Column-parallel layers cut
rows of the weight and of its scales; row-parallel layers cut input features, which must start
on a group / block: the sizes below make some layers cut through one, and those load dequantized
with the reason in the start-up line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers.quantized_checkpoints import write_fp8_blocks, write_mxfp4
from tests.helpers.quantized_int4_checkpoints import Int4Format, write_int4_checkpoint
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_models import save_tiny_model
from worker.config import ModelConfig, ParallelConfig
from worker.model_loader import load_model
from worker.quantization.execution import QuantizedWeights, choose_path

pytest.importorskip("triton")


def _gptq(path: Path) -> Path:
    """o_proj inputs (64) split on a group of 32; down_proj inputs (96 -> 48) do not."""
    save_tiny_model("llama", path / "plain", num_hidden_layers=1, intermediate_size=96)
    return write_int4_checkpoint(path / "plain", path / "gptq", Int4Format("gptq", 32))


def _fp8_blocks(path: Path) -> Path:
    """Inputs of 256 split on a 128 block (o_proj); 384 -> 192 do not (down_proj)."""
    save_tiny_model("llama", path, num_hidden_layers=1, hidden_size=256, intermediate_size=384)
    write_fp8_blocks(path)
    return path


def _mxfp4(path: Path) -> Path:
    """Experts' intermediate 64 -> 32 per rank: one whole MXFP4 block of down_proj inputs."""
    config = {**GPT_OSS, "num_hidden_layers": 1, "intermediate_size": 64}
    config["layer_types"] = ["full_attention"]
    save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", config, path)
    write_mxfp4(path)
    return path


CASES: dict[str, tuple[Callable[[Path], Path], set[str]]] = {
    "gptq": (_gptq, {"model.layers.0.mlp.down_proj"}),
    "fp8-blocks": (_fp8_blocks, {"model.layers.0.mlp.down_proj"}),
    "mxfp4": (_mxfp4, set()),
}
"""case -> (checkpoint writer, layers whose row split cuts a group and load dequantized)."""


def _load(folder: Path, rank: int, mode: str) -> torch.nn.Module:
    config = ModelConfig.from_pretrained(str(folder), dtype="float32")
    return load_model(
        config, ParallelConfig(tp_size=2, rank=rank), "cpu", quantized_weight_mode=mode
    )


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_keeps_the_quantized_parts_of_its_dequantized_shard(
    case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write, cut_through = CASES[case]
    folder = write(tmp_path)
    for rank in range(2):
        dense = dict(_load(folder, rank, "dequantize").named_modules())
        with caplog.at_level(logging.INFO, logger="worker.quantization.execution"):
            kept = _load(folder, rank, "kernels")
        quantized = {
            name: module.quantized
            for name, module in kept.named_modules()
            if isinstance(getattr(module, "quantized", None), QuantizedWeights)
        }
        assert quantized, "no layer kept its quantized weights"
        for name, weights in quantized.items():
            for param, layout in weights.layouts.items():
                want = getattr(dense[name], param)
                torch.testing.assert_close(layout.dequantize(), want, rtol=0, atol=0)
        for name in cut_through:
            assert name not in quantized
            torch.testing.assert_close(
                dict(kept.named_modules())[name].weight, dense[name].weight, rtol=0, atol=0
            )
        if cut_through:
            assert "dequantized at load (input features" in caplog.text
        caplog.clear()


def test_the_path_is_kernels_on_cuda_and_dequantized_on_cpu() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not choose_path("auto", cpu).use_kernels
    assert choose_path("auto", cuda).use_kernels
    assert choose_path("kernels", cpu).use_kernels
    assert not choose_path("dequantize", cuda).use_kernels
    with pytest.raises(ValueError, match="quantized_weight_mode must be one of"):
        choose_path("fast", cpu)


def test_cpu_loads_keep_no_quantized_layer(tmp_path: Path) -> None:
    """The default on CPU: every weight dequantized at load, no layer holds kernel parts."""
    folder = _gptq(tmp_path)
    model = load_model(
        ModelConfig.from_pretrained(str(folder), dtype="float32"), ParallelConfig(), "cpu"
    )
    assert all(getattr(module, "quantized", None) is None for module in model.modules())


def test_adapter_factors_are_cut_by_the_loaders_of_layers_kept_quantized(tmp_path: Path) -> None:
    """LoRA cuts its factors with the base weight's loader after load: on a layer kept
    quantized (rank 1 of 2) that still copies this rank's input columns (o_proj's A, 64 -> 32)
    or rows of a shard (the gate's B, 96 -> 48) into the factor, and leaves the kernel on."""
    layers = dict(_load(_gptq(tmp_path), 1, "kernels").named_modules())
    cases = (  # layer, full factor, shard, this rank's part
        ("model.layers.0.self_attn.o_proj", torch.randn(3, 64), None, (slice(None), slice(32, 64))),
        ("model.layers.0.mlp.gate_up_proj", torch.randn(96, 3), 0, (slice(48, 96), slice(None))),
    )
    for name, full, shard, part in cases:
        layer = layers[name]
        assert isinstance(layer.quantized, QuantizedWeights)
        target = torch.nn.Parameter(torch.zeros(full[part].shape), requires_grad=False)
        layer.weight.weight_loader(target, full, shard)
        torch.testing.assert_close(target.data, full[part], rtol=0, atol=0)
        assert isinstance(layer.quantized, QuantizedWeights)

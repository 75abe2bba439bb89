"""Quantized checkpoints through the offline `LLM` against transformers running the same
weights dequantized (CPU fp32): MXFP4 gpt-oss experts (transformers loads that checkpoint
itself, `Mxfp4Config(dequantize=True)`), block FP8 Qwen3.5 MoE and Qwen3-Next with its MTP
layer (128x128 blocks over matrices of one, several and partial blocks), compressed-tensors FP8
per tensor and per channel on Llama and Granite-4.0-H (dequantized by the independent
reference in tests/helpers/quantized_checkpoints.py). Greedy tokens must be identical.

A checkpoint we cannot read (scales missing or misshapen, an unknown method or scheme, a
`quantization` argument that does not match) stops `LLM(...)` with one line naming the
tensor or scheme; the start-up log reports what dequantizing cost, once.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from cluster import LLM, SamplingParams
from tests.helpers.engine_probe import record_drafts
from tests.helpers.quantized_checkpoints import (
    FILE,
    read_tensors,
    reference_model,
    write_compressed_fp8,
    write_fp8_blocks,
    write_mxfp4,
    write_reference,
)
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import hf_greedy, save_tiny_model
from tests.helpers.tiny_mtp import ReferenceMtp, save_tiny_with_mtp

pytestmark = pytest.mark.parity

NUM_NEW = 8
PROMPTS = [[(7 * i + 3) % 256 for i in range(21)], [(11 * i + 5) % 256 for i in range(6)]]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,  # the first prompt is prefilled in two chunks
    "kv_cache_memory_bytes": 1 << 22,
}
# Sizes over 128x128 blocks: hidden 192 (one full and one partial block of columns), expert
# rows 160, shared-expert rows 320 (two full blocks and a partial one).
BLOCK_SIZES = {
    "hidden_size": 192,
    "moe_intermediate_size": 160,
    "shared_expert_intermediate_size": 320,
}


def _gpt_oss_mxfp4(path: Path, _: Path) -> torch.nn.Module:
    save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, path)
    write_mxfp4(path)
    model = transformers.GptOssForCausalLM.from_pretrained(
        path,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    return model.eval()


def _qwen3_5_moe_fp8_blocks(path: Path, reference: Path) -> torch.nn.Module:
    save_tiny_linear_hybrid("qwen3_5_moe", path, **BLOCK_SIZES)
    write_fp8_blocks(path, scale_dtype=torch.bfloat16)  # Qwen3.5's releases: bf16 scales
    return reference_model(path, reference, "Qwen3_5MoeForCausalLM")


def _compressed_fp8(family: str, strategy: str) -> Callable[[Path, Path], torch.nn.Module]:
    def build(path: Path, reference: Path) -> torch.nn.Module:
        if family == "llama":
            save_tiny_model("llama", path)
            model_class = "LlamaForCausalLM"
        else:
            save_tiny_hybrid("granitemoehybrid", path)
            model_class = "GraniteMoeHybridForCausalLM"
        write_compressed_fp8(path, strategy)
        return reference_model(path, reference, model_class)

    return build


CASES: dict[str, Callable[[Path, Path], torch.nn.Module]] = {
    "gpt_oss_mxfp4": _gpt_oss_mxfp4,
    "qwen3_5_moe_fp8_blocks": _qwen3_5_moe_fp8_blocks,
    "llama_ct_fp8_tensor": _compressed_fp8("llama", "tensor"),
    "llama_ct_fp8_channel": _compressed_fp8("llama", "channel"),
    "granite_4_h_ct_fp8_channel": _compressed_fp8("granite", "channel"),
}


def _llm_greedy(path: Path, **overrides: Any) -> list[list[int]]:
    llm = LLM(str(path), **{**LLM_ARGS, **overrides})
    try:
        return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_match_transformers_on_dequantized_weights(case: str, tmp_path: Path) -> None:
    reference = CASES[case](tmp_path / "quantized", tmp_path / "reference")
    expected = [hf_greedy(reference, prompt, NUM_NEW) for prompt in PROMPTS]
    assert _llm_greedy(tmp_path / "quantized") == expected


def test_qwen3_next_fp8_blocks_with_mtp_drafts_as_its_reference(tmp_path: Path) -> None:
    """The target and its MTP layer (experts, attention, shared expert: all FP8 blocks) load
    dequantized: greedy tokens are transformers', every MTP proposal the reference MTP's
    forward over the dequantized weights."""
    quantized, plain = tmp_path / "quantized", tmp_path / "reference"
    save_tiny_with_mtp("qwen3_next", quantized, **BLOCK_SIZES)
    write_fp8_blocks(quantized)
    write_reference(quantized, plain)
    target = transformers.Qwen3NextForCausalLM.from_pretrained(
        plain, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    mtp = ReferenceMtp(target, plain)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(str(quantized), speculative_config=spec, **LLM_ARGS)
    try:
        with record_drafts(llm) as proposals:
            results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [r.outputs[0].token_ids for r in results] == [
        hf_greedy(target, prompt, NUM_NEW) for prompt in PROMPTS
    ]
    assert len(proposals) >= len(PROMPTS)
    for known, drafts in proposals:
        assert drafts == mtp.drafts(known, 2), known


# ---- what is refused, and the start-up report -------------------------------------------


@pytest.fixture(scope="module")
def plain_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plain_llama")
    save_tiny_model("llama", path)
    return path


def _copy(source: Path, target: Path, write: Callable[[Path], None] | None = None) -> Path:
    shutil.copytree(source, target)
    if write is not None:
        write(target)
    return target


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = read_tensors(path)
    edit(tensors)
    save_file(tensors, path / FILE, metadata={"format": "pt"})


def _edit_quant_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


def _check_start_error(path: Path, expected: str, **overrides: Any) -> None:
    """`LLM(...)` (one rank, in-process) stops with a one-line ValueError matching `expected`."""
    with pytest.raises(ValueError, match=expected) as info:
        LLM(str(path), **{**LLM_ARGS, **overrides})
    assert "\n" not in str(info.value)


DOWN = "model.layers.1.mlp.down_proj"


def _drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    return lambda tensors: tensors.__delitem__(name)


def _shorten(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:-1]

    return edit


BROKEN_TENSORS: dict[str, tuple[str, Callable[[dict[str, torch.Tensor]], None], str]] = {
    "ct_scale_missing": (
        "channel",
        _drop(f"{DOWN}.weight_scale"),
        rf"{DOWN}\.weight is F8_E4M3 but has no weight_scale",
    ),
    "ct_scale_misshapen": (
        "channel",
        _shorten(f"{DOWN}.weight_scale"),
        rf"{DOWN}\.weight_scale has shape \(63, 1\), expected \(64, 1\)",
    ),
    "fp8_block_scale_missing": (
        "blocks",
        _drop(f"{DOWN}.weight_scale_inv"),
        rf"{DOWN}\.weight is F8_E4M3 but has no weight_scale_inv",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_TENSORS))
def test_missing_or_misshapen_scales_stop_start_up_naming_the_tensor(
    case: str, plain_llama: Path, tmp_path: Path
) -> None:
    layout, edit, expected = BROKEN_TENSORS[case]
    path = _copy(
        plain_llama,
        tmp_path / case,
        write_fp8_blocks if layout == "blocks" else lambda p: write_compressed_fp8(p, layout),
    )
    _edit_tensors(path, edit)
    _check_start_error(path, expected)


def test_misshapen_mxfp4_scales_stop_start_up_naming_the_tensor(tmp_path: Path) -> None:
    save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, tmp_path)
    write_mxfp4(tmp_path)
    experts = "model.layers.2.mlp.experts.down_proj"
    _edit_tensors(tmp_path, _shorten(f"{experts}_scales"))
    expected = rf"{experts}_scales has shape \(3, 64, 1\), expected \(4, 64, 1\)"
    _check_start_error(tmp_path, expected)


def _int8_w8a8(quant: dict[str, Any]) -> None:
    quant["format"] = "int-quantized"
    group = quant["config_groups"]["group_0"]
    group["weights"]["type"] = group["input_activations"]["type"] = "int"


def _nvfp4(quant: dict[str, Any]) -> None:
    quant["format"] = "nvfp4-pack-quantized"
    weights = quant["config_groups"]["group_0"]["weights"]
    weights.update(num_bits=4, strategy="tensor_group", group_size=16)
    quant["config_groups"]["group_0"]["input_activations"]["num_bits"] = 4


def _sparse_24(quant: dict[str, Any]) -> None:
    quant["sparsity_config"] = {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}


def _fp8_groups(quant: dict[str, Any]) -> None:
    quant["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128)


def _unknown_method(quant: dict[str, Any]) -> None:
    quant["quant_method"] = "bitsandbytes"


BAD_CONFIGS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "int8_w8a8": (
        _int8_w8a8,
        r"scheme W8A8 int8 \(int-quantized, channel\) \(config group group_0\)",
    ),
    "nvfp4": (_nvfp4, r"scheme NVFP4 \(nvfp4-pack-quantized, tensor_group\)"),
    "sparse_2_4": (_sparse_24, r"scheme 2:4 sparse weights \(sparse-24-bitmask\)"),
    "fp8_group_strategy": (_fp8_groups, r"group_0: FP8 weights with strategy 'group'"),
    "unknown_method": (_unknown_method, r"quantization method 'bitsandbytes' of .* not supported"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unsupported_methods_and_schemes_stop_start_up_naming_them(
    case: str, plain_llama: Path, tmp_path: Path
) -> None:
    edit, expected = BAD_CONFIGS[case]
    path = _copy(plain_llama, tmp_path / case, lambda p: write_compressed_fp8(p, "channel"))
    _edit_quant_config(path, edit)
    _check_start_error(path, expected)


def test_quantization_argument_only_confirms_the_checkpoints_method(
    plain_llama: Path, tmp_path: Path
) -> None:
    _check_start_error(
        plain_llama,
        r"quantization='fp8' needs a checkpoint quantized with it, but .* has no "
        r"quantization_config",
        quantization="fp8",
    )
    path = _copy(plain_llama, tmp_path / "ct", lambda p: write_compressed_fp8(p, "tensor"))
    _check_start_error(
        path,
        r"quantization='awq' does not match the checkpoint's method 'compressed-tensors'",
        quantization="awq",
    )
    assert _llm_greedy(path, quantization="compressed-tensors")  # confirming it is fine


def test_start_up_log_reports_dequantization_cost_once(
    plain_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _copy(plain_llama, tmp_path / "ct", lambda p: write_compressed_fp8(p, "tensor"))
    tensors = read_tensors(path)
    weights = [t for name, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    stored = sum(
        t.numel() * t.element_size()
        for t in tensors.values()
        if t.dim() and (t.dtype == torch.float8_e4m3fn or t.numel() == 1)
    )
    parameters = sum(t.numel() for t in weights)
    with caplog.at_level(logging.INFO, logger="worker.weights"):
        _llm_greedy(path)
    reports = [
        r.getMessage()
        for r in caplog.records
        if r.name == "worker.weights" and "dequantized" in r.getMessage()
    ]
    assert len(reports) == 1, reports
    assert reports[0].startswith(
        f"dequantized {len(weights)} compressed-tensors tensors "
        f"({parameters / 1e6:.1f}M parameters) at load"
    )
    assert reports[0].endswith(f"as float32 ({parameters * 4 / stored:.2f}x)")

"""Quantized checkpoints through the offline `LLM` against transformers running the same
weights dequantized (CPU fp32): MXFP4 gpt-oss experts (transformers loads that checkpoint
itself, `Mxfp4Config(dequantize=True)`), block FP8 Qwen3.5 MoE and Qwen3-Next with its MTP
layer (128x128 blocks over matrices of one, several and partial blocks), compressed-tensors FP8
per tensor and per channel on Llama and Granite-4.0-H (dequantized by the independent
reference in tests/helpers/quantized_checkpoints.py). Greedy tokens must be identical.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from cluster import LLM, SamplingParams
from tests.helpers.engine_probe import record_drafts
from tests.helpers.quantized_checkpoints import (
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

"""The quantized-checkpoint figure of the GPU check: quantized weights on the kernels against
the same checkpoint dequantized at load, end to end through `LLM`.

Two checkpoints are written on the fly from random models, as the releases store them
(`tests/helpers/quantized_checkpoints.py`): a Llama-8B-layer-shaped model in 128x128 block FP8
(Qwen "-FP8" style) and a gpt-oss-20b-layer-shaped model with MXFP4 experts (fewer layers and
experts, so that the files stay a few GB). Each is served twice, `quantized_weight_mode` "auto"
(on CUDA: the Triton block-FP8 GEMM / MXFP4 MoE GEMM) and "dequantize", and generates greedily
for a batch of prompts; a row reports the decode step time of each path (the time of
`1 + new_tokens` tokens minus that of one, over `new_tokens`), their ratio, the greedy
agreement (share of generated tokens before the first difference, and of first tokens) and
the start-up line saying which layers ran which kernel. `tiny` (the CPU dry run) swaps in
two-layer models of a few hundred parameters a layer; on CPU "auto" dequantizes, so the dry
run checks the plumbing only.
"""

from __future__ import annotations

import gc
import logging
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from cluster import LLM, SamplingParams
from tests.helpers.quantized_checkpoints import write_fp8_blocks, write_mxfp4

LLAMA_LAYERS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 4096, "tie_word_embeddings": False,
}  # fmt: skip
GPT_OSS_LAYERS = {
    "vocab_size": 32000, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"], "max_position_embeddings": 4096,
}  # fmt: skip
TINY_LLAMA = {**LLAMA_LAYERS, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
TINY_GPT_OSS = {**GPT_OSS_LAYERS, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "num_local_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
EXECUTION_LOGGER = "worker.quantization.execution"


@dataclass(frozen=True)
class QuantCase:
    """One checkpoint to write and serve both ways."""

    name: str
    config_class: str
    shape: dict[str, Any]
    write: Callable[[Path], None]


@dataclass(frozen=True)
class QuantRun:
    batch: int
    prompt_len: int
    new_tokens: int
    dtype: torch.dtype
    device: str
    cases: tuple[QuantCase, ...]


def quant_e2e_run(tiny: bool, device: torch.device) -> QuantRun:
    if tiny:
        cases = (
            QuantCase("fp8-block Llama (tiny)", "LlamaConfig", TINY_LLAMA, write_fp8_blocks),
            QuantCase("mxfp4 gpt-oss (tiny)", "GptOssConfig", TINY_GPT_OSS, write_mxfp4),
        )
        return QuantRun(2, 8, 4, torch.float32, device.type, cases)
    cases = (
        QuantCase("fp8-block Llama-8B layers x2", "LlamaConfig", LLAMA_LAYERS, write_fp8_blocks),
        QuantCase("mxfp4 gpt-oss-20b layers x2, 8 experts", "GptOssConfig", GPT_OSS_LAYERS,
                  write_mxfp4),
    )  # fmt: skip
    return QuantRun(16, 128, 64, torch.bfloat16, device.type, cases)


def quant_e2e_figures(run: QuantRun) -> list[dict[str, object]]:
    """One row per checkpoint: both paths' decode step time and their greedy agreement."""
    rows = []
    for case in run.cases:
        with tempfile.TemporaryDirectory() as folder:
            _write_checkpoint(case, Path(folder), run.device)
            kernels = _serve(Path(folder), "auto", run)
            dequantized = _serve(Path(folder), "dequantize", run)
        rows.append(_row(case, run, kernels, dequantized))
    return rows


def _row(
    case: QuantCase, run: QuantRun, kernels: dict[str, Any], dense: dict[str, Any]
) -> dict[str, object]:
    pairs = list(zip(kernels["tokens"], dense["tokens"], strict=True))
    agreeing = sum(_common_prefix(a, b) for a, b in pairs) / (len(pairs) * run.new_tokens)
    return {
        "checkpoint": case.name,
        "batch": run.batch,
        "kernel_ms_per_step": round(kernels["seconds_per_step"] * 1e3, 3),
        "dequantized_ms_per_step": round(dense["seconds_per_step"] * 1e3, 3),
        "kernel_vs_dequantized": round(dense["seconds_per_step"] / kernels["seconds_per_step"], 3),
        "greedy_agreement": round(agreeing, 3),
        "first_token_agreement": round(sum(a[0] == b[0] for a, b in pairs) / len(pairs), 3),
        "kernel_path": " | ".join(kernels["log"]),
    }  # fmt: skip


def _common_prefix(a: list[int], b: list[int]) -> int:
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    return same


def _write_checkpoint(case: QuantCase, folder: Path, device: str) -> None:
    """A random model of the case's shape, saved (weights made on the device for speed) and
    rewritten in the case's quantized format."""
    config = getattr(transformers, case.config_class)(
        **case.shape, eos_token_id=None, bos_token_id=None, pad_token_id=None
    )
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    del model
    _release_memory()
    case.write(folder)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _serve(folder: Path, mode: str, run: QuantRun) -> dict[str, Any]:
    """Greedy tokens and decode seconds per step of the checkpoint in `folder` under `mode`."""
    lines = _Lines()
    logger = logging.getLogger(EXECUTION_LOGGER)
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(run.prompt_len)] for _ in range(run.batch)]
    try:
        llm = LLM(str(folder), quantized_weight_mode=mode, device=run.device,
                  dtype=str(run.dtype).removeprefix("torch."), max_num_seqs=run.batch,
                  enable_prefix_caching=False,
                  max_model_len=run.prompt_len + run.new_tokens + 16)  # fmt: skip
    finally:
        logger.removeHandler(lines)
    try:

        def generate(num: int) -> list[list[int]]:
            params = SamplingParams(temperature=0, max_tokens=num, ignore_eos=True)
            results = llm.generate(prompts, params, use_tqdm=False)
            return [list(result.outputs[0].token_ids) for result in results]

        tokens = generate(run.new_tokens)  # warm-up, and the greedy tokens
        start = time.perf_counter()
        generate(1)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        generate(1 + run.new_tokens)
        decode = time.perf_counter() - start - prefill
    finally:
        llm.shutdown()
        _release_memory()
    return {
        "tokens": tokens,
        "seconds_per_step": max(decode, 1e-9) / run.new_tokens,
        "log": lines.lines,
    }


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

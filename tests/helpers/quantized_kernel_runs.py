"""Tiny quantized checkpoints run twice, dequantized at load and on the quantized-weight
kernels (`quantized_weight_mode="kernels"`), through the paged model on CPU.

Run as `python -m tests.helpers.quantized_kernel_runs OUT.json [--tensor-parallel]` with
TRITON_INTERPRET=1 set
(the Triton kernels then run in the interpreter); it writes, per case, both paths' greedy
tokens, the largest first-step (prefill) logit difference relative to the largest logit, and
the execution log lines of the kernel path (which layer ran which kernel). FP8 kernels also
quantize activations, so FP8 cases add a third run: the dequantized model with every
projection's input rounded to e4m3 in torch (`kernels.quant_reference`: per token per 128
channels for blocks, per token for channels), the arithmetic the kernels should reproduce.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels import quant_reference
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.quantized_checkpoints import write_compressed_fp8, write_fp8_blocks, write_mxfp4
from tests.helpers.quantized_int4_checkpoints import Int4Format, write_int4_checkpoint
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_models import save_tiny_model
from worker.config import ModelConfig, ParallelConfig
from worker.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from worker.model_loader import load_model

PROMPTS = {"a": [(7 * i + 3) % 200 for i in range(11)], "b": [(11 * i + 5) % 200 for i in range(5)]}
NUM_NEW = 5
LLAMA = {"num_hidden_layers": 1}


def _llama(path: Path) -> Path:
    save_tiny_model("llama", path, **LLAMA)
    return path


def _int4(fmt: Int4Format) -> Callable[[Path], Path]:
    def write(path: Path) -> Path:
        return write_int4_checkpoint(_llama(path / "plain"), path / fmt.label, fmt)

    return write


def _rewritten(writer: Callable[[Path], None]) -> Callable[[Path], Path]:
    def write(path: Path) -> Path:
        writer(_llama(path))
        return path

    return write


def _gpt_oss(path: Path) -> Path:
    layers = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}
    save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", {**GPT_OSS, **layers}, path)
    write_mxfp4(path)
    return path


CASES: dict[str, Callable[[Path], Path]] = {
    "llama-gptq": _int4(Int4Format("gptq", 32)),
    "llama-awq": _int4(Int4Format("awq", 32)),
    "llama-w4a16": _int4(Int4Format("compressed-tensors", 32, symmetric=True)),
    "gpt-oss-mxfp4": _gpt_oss,
    "llama-fp8-block": _rewritten(write_fp8_blocks),
    "llama-fp8-channel": _rewritten(lambda path: write_compressed_fp8(path, "channel")),
}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fp8_block_activations(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    values, scales = quant_reference.quantize_fp8_groups(flat, 128)
    expanded = quant_reference.expand_scales(scales, *flat.shape, (1, 128))
    return (values.float() * expanded).reshape(x.shape).to(x.dtype)


def _fp8_token_activations(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    values, scales = quant_reference.quantize_fp8_rows(flat)
    return (values.float() * scales).reshape(x.shape).to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "llama-fp8-block": _fp8_block_activations,
    "llama-fp8-channel": _fp8_token_activations,
}
"""How each FP8 case's kernels quantize a projection's input."""


def _quantize_inputs(
    model: torch.nn.Module, rounding: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | ReplicatedLinear):
            module.register_forward_pre_hook(lambda _, args: (rounding(args[0]),))


def _run(
    folder: Path, mode: str, rounding: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor], list[str]]:
    lines = _Lines()
    execution = logging.getLogger("worker.quantization.execution")
    execution.addHandler(lines)
    execution.setLevel(logging.INFO)
    try:
        config = ModelConfig.from_pretrained(str(folder), dtype="float32")
        model = load_model(config, ParallelConfig(), "cpu", quantized_weight_mode=mode)
    finally:
        execution.removeHandler(lines)
    if rounding is not None:
        _quantize_inputs(model, rounding)
    first = PagedDriver(model).step(PROMPTS)
    tokens = PagedDriver(model).generate(PROMPTS, NUM_NEW)
    return tokens, first, lines.lines


def run_case(name: str, root: Path) -> dict[str, Any]:
    folder = CASES[name](root / name)
    want, want_logits, _ = _run(folder, "dequantize")
    got, got_logits, lines = _run(folder, "kernels")
    result = {
        "dequantized": want,
        "kernels": got,
        "first_step_error": _error(got_logits, want_logits),
        "log": lines,
    }
    if name in ACTIVATIONS:
        emulated, emulated_logits, _ = _run(folder, "dequantize", ACTIVATIONS[name])
        result["activations_quantized"] = emulated
        result["first_step_error_to_activations_quantized"] = _error(got_logits, emulated_logits)
    return result


def _error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest |difference| of the first step's logits over the largest |logit|."""
    return max(float((got[r] - want[r]).abs().max() / want[r].abs().max()) for r in PROMPTS)


def run_tensor_parallel(root: Path) -> dict[str, Any]:
    """The GPTQ case over two ranks (mp executor, a process each) on the kernels through
    `LLM`, and one rank dequantized at load through the paged model."""
    from cluster import LLM, SamplingParams

    folder = CASES["llama-gptq"](root / "llama-gptq")
    want, _, _ = _run(folder, "dequantize")
    llm = LLM(str(folder), quantized_weight_mode="kernels", tensor_parallel_size=2,
              dtype="float32", block_size=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=1 << 22)  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0, max_tokens=NUM_NEW)
        results = llm.generate(list(PROMPTS.values()), greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    got = {name: list(r.outputs[0].token_ids) for name, r in zip(PROMPTS, results, strict=True)}
    return {"dequantized": want, "kernels_tp2": got}


def main(out: str, tensor_parallel: bool) -> None:
    with tempfile.TemporaryDirectory() as root:
        if tensor_parallel:
            results = run_tensor_parallel(Path(root))
        else:
            results = {name: run_case(name, Path(root)) for name in CASES}
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], "--tensor-parallel" in sys.argv[2:])

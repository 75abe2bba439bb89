"""Quantized checkpoints on the quantized-weight kernels against the same checkpoints
dequantized at load, on CPU with the Triton kernels in the interpreter.

One fresh subprocess with TRITON_INTERPRET=1 (`tests/helpers/quantized_kernel_runs.py`) loads
each tiny checkpoint (1-layer Llama in GPTQ, AWQ and compressed-tensors W4A16, groups of 32;
2-layer gpt-oss with MXFP4 experts; 1-layer Llama in block FP8 and compressed-tensors
per-channel FP8) with `quantized_weight_mode` "dequantize" and "kernels", fp32, and runs both
through the paged model. Tolerances (largest first-step logit difference over the largest
logit): weight-only formats 1e-5 and the same greedy tokens; FP8, which also quantizes
activations, 1e-5 and the same tokens against the dequantized model whose projection inputs
are rounded to e4m3 as the kernels round them, and against the plain dequantized model at most
0.2 (measured 0.09-0.12 on these random models) with the same first token. Marked slow: the
same GPTQ checkpoint over two tensor-parallel ranks on the kernels, through `LLM`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernels import HAS_TRITON

pytestmark = [
    pytest.mark.parity,
    pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
WEIGHT_ONLY = {
    "llama-gptq": "Triton W4A16 int4 GEMM",
    "llama-awq": "Triton W4A16 int4 GEMM",
    "llama-w4a16": "Triton W4A16 int4 GEMM",
    "gpt-oss-mxfp4": "Triton MXFP4 MoE GEMM",
}
FP8 = {"llama-fp8-block": "Triton block-FP8 GEMM", "llama-fp8-channel": "torch._scaled_mm FP8"}
EXACT = 1e-5
FP8_AGAINST_16_BIT = 0.2


def _interpreted_runs(out: Path, *flags: str) -> dict[str, Any]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.quantized_kernel_runs", str(out), *flags],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _interpreted_runs(tmp_path_factory.mktemp("kernel_runs") / "runs.json")


def _ran_on(run: dict[str, Any], kernel: str) -> None:
    """The start-up line names the kernel for every quantized layer, none dequantized."""
    (line,) = run["log"]
    assert f"on {kernel}:" in line, line
    assert "dequantized" not in line, line


@pytest.mark.parametrize("case", list(WEIGHT_ONLY))
def test_weight_only_kernels_give_the_dequantized_tokens(runs: dict[str, Any], case: str) -> None:
    run = runs[case]
    _ran_on(run, WEIGHT_ONLY[case])
    assert run["first_step_error"] < EXACT
    assert run["kernels"] == run["dequantized"]


@pytest.mark.parametrize("case", list(FP8))
def test_fp8_kernels_compute_with_activations_rounded_to_e4m3(
    runs: dict[str, Any], case: str
) -> None:
    run = runs[case]
    _ran_on(run, FP8[case])
    assert run["first_step_error_to_activations_quantized"] < EXACT
    assert run["kernels"] == run["activations_quantized"]
    assert run["first_step_error"] < FP8_AGAINST_16_BIT
    first_tokens = {prompt: tokens[0] for prompt, tokens in run["dequantized"].items()}
    assert {prompt: tokens[0] for prompt, tokens in run["kernels"].items()} == first_tokens


@pytest.mark.slow
def test_two_tensor_parallel_ranks_on_the_int4_kernel_give_the_dequantized_tokens(
    tmp_path: Path,
) -> None:
    """GPTQ over two ranks (a process each, both in the interpreter): column layers keep
    their rows of the packed codes, scales and zero points, row layers their groups of input
    features, and the all-reduced partial sums give one dequantized rank's tokens (~15 s)."""
    run = _interpreted_runs(tmp_path / "tp.json", "--tensor-parallel")
    assert run["kernels_tp2"] == run["dequantized"]

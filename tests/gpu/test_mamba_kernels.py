"""Triton Mamba-2 kernels against the torch reference on CUDA (fp32 and bf16 inputs), and a
hybrid model's greedy tokens with the Triton kernels against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import mamba_reference, triton_mamba
from kernels.mamba_registry import select_mamba_kernels
from kernels.mamba_testing import make_mamba_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# prefill longer than a chunk, continued chunk, decodes, a fresh one-token prompt
SEQS = ((700, False), (129, True), (1, True), (1, True), (1, False), (64, True))
ATOL = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "groups", "head_dim", "state"), [(8, 1, 64, 128), (16, 8, 32, 64)]
)
def test_triton_mamba_kernels_match_reference(
    dtype: torch.dtype, heads: int, groups: int, head_dim: int, state: int
) -> None:
    assert select_mamba_kernels("auto", "cuda").name == "triton"
    b = make_mamba_batch(
        SEQS, heads=heads, groups=groups, head_dim=head_dim, state=state, device="cuda",
        dtype=dtype,
    )  # fmt: skip
    cuts = [256, 512, 700 + 64]
    conv_args = (b.xbc, b.conv_weight, b.conv_bias, b.conv_init, b.qsl, "silu", cuts)
    for want, got in zip(
        mamba_reference.causal_conv1d(*conv_args), triton_mamba.causal_conv1d(*conv_args),
        strict=True,
    ):  # fmt: skip
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL[dtype], rtol=ATOL[dtype])
    scan_args = (b.x, b.dt, b.A, b.B, b.C, b.D, b.dt_bias, b.ssm_init, b.qsl, 256)
    want = mamba_reference.ssd_scan(*scan_args, cut_positions=cuts)
    got = triton_mamba.ssd_scan(*scan_args, cut_positions=cuts)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("family", ["granitemoehybrid", "nemotron_h"])
def test_hybrid_greedy_tokens_on_gpu_fp32(family: str, tmp_path: Path) -> None:
    from cluster import LLM, SamplingParams
    from tests.helpers.tiny_hybrid import save_tiny_hybrid

    hf_model = save_tiny_hybrid(family, tmp_path).to("cuda")
    prompts = [[(7 * i + 3) % 256 for i in range(30)], [(13 * i + 1) % 256 for i in range(17)]]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=4,
              max_num_batched_tokens=24, kv_cache_memory_bytes=1 << 24)  # fmt: skip
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    llm.shutdown()
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False
            )
        assert result.outputs[0].token_ids == out[0, len(prompt) :].tolist()

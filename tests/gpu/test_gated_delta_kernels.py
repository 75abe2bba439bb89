"""fla-core's gated delta rule against the torch reference on CUDA (prefill chunks with cut
states, decode steps), through the kernel registry; linear-attention hybrids served on CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import gated_delta_reference as ref
from kernels.gated_delta_registry import select_gated_delta_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")


def _inputs(num_tokens: int, hk: int, hv: int, dim: int) -> ref.DeltaRuleInputs:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda")

    return ref.DeltaRuleInputs(
        q=ref.l2_normalize(rand(num_tokens, hk, dim)),
        k=ref.l2_normalize(rand(num_tokens, hk, dim)),
        v=rand(num_tokens, hv, dim),
        g=-F.softplus(rand(num_tokens, hv)),
        beta=torch.sigmoid(rand(num_tokens, hv)),
    )


@needs_fla
@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_fla_gated_delta_rule_matches_the_reference(form: str) -> None:
    kernels = select_gated_delta_kernels("cuda")
    assert kernels.name == "fla"
    starts = [0, 300, 301, 302, 429] if form == "chunked" else [0, 1, 2, 3]
    cuts = [128, 256, 400] if form == "chunked" else []
    inputs = _inputs(starts[-1], 2, 4, 64)
    states = torch.randn(len(starts) - 1, 4, 64, 64, device="cuda") * 0.1
    fn = kernels.chunked if form == "chunked" else kernels.recurrent
    want_fn = ref.chunked_gated_delta_rule if form == "chunked" else ref.recurrent_gated_delta_rule
    # fla's chunked kernel takes bf16 (fp32 goes to the reference); compare with fp32 math.
    half = ref.DeltaRuleInputs(*(x.to(torch.bfloat16) for x in inputs[:3]), inputs.g, inputs.beta)
    got = fn(half, states, starts, 64**-0.5, cuts)
    exact = ref.DeltaRuleInputs(*(x.float() for x in half[:3]), inputs.g, inputs.beta)
    want = want_fn(exact, states, starts, 64**-0.5, cuts)
    for got_part, want_part in zip(got, want, strict=True):
        torch.testing.assert_close(got_part.float(), want_part, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "lfm2"])
def test_linear_hybrid_greedy_tokens_on_gpu_fp32(family: str, tmp_path: Path) -> None:
    """The served model on CUDA (fla-core for decode steps when installed) against
    transformers on CUDA."""
    from cluster import LLM, SamplingParams
    from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

    hf_model = save_tiny_linear_hybrid(family, tmp_path).to("cuda")
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

"""Greedy parity with transformers on the GPU in bf16, one tiny random model per layout.

Llama (full attention), Gemma 3 (sliding window + global), Gemma 4 (K = V, KV sharing, two page
sizes), gpt-oss (sinks, MoE), Bamba (Mamba-2 hybrid) and Qwen3-Next (gated DeltaNet hybrid),
served by the offline `LLM` on CUDA with the default kernels (Triton attention, Triton Mamba-2,
fla-core's gated delta rule when installed) against transformers' eager bf16 forward on CUDA.

bf16 rounding differs between any two implementations, so the rule is: greedy tokens equal
transformers', or at the first divergence each side's token is in the other's top 5 (then the
comparison stops).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.helpers.tiny_gemma4_gpt_oss import GEMMA4, GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[(7 * i + 3) % 256 for i in range(30)], [(13 * i + 1) % 256 for i in range(17)]]
NUM_NEW = 16
SAVERS: dict[str, Callable[[Path], torch.nn.Module]] = {
    "llama": lambda path: save_tiny_model("llama", path),
    "gemma3": lambda path: save_tiny_model("gemma3", path),
    "gemma4": lambda path: save_gemma4_or_gpt_oss(
        "Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4, path
    ),
    "gpt_oss": lambda path: save_gemma4_or_gpt_oss(
        "GptOssConfig", "GptOssForCausalLM", GPT_OSS, path
    ),
    "bamba": lambda path: save_tiny_hybrid("bamba", path),
    "qwen3_next": lambda path: save_tiny_linear_hybrid("qwen3_next", path),
}


def _transformers_greedy(
    hf_model: torch.nn.Module, prompt: list[int]
) -> tuple[list[int], list[list[int]]]:
    """transformers' greedy tokens and, per step, its top-5 token IDs."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top5 = [scores[0].topk(5).indices.tolist() for scores in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), top5


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_bf16_on_gpu_follows_transformers(family: str, tmp_path: Path) -> None:
    hf_model = SAVERS[family](tmp_path).to("cuda", torch.bfloat16)
    llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", block_size=16,
              kv_cache_memory_bytes=1 << 26)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=5)
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.shutdown()
    for prompt, result in zip(PROMPTS, results, strict=True):
        theirs, their_top5 = _transformers_greedy(hf_model, prompt)
        ours, our_logprobs = result.outputs[0].token_ids, result.outputs[0].logprobs
        assert our_logprobs is not None
        for step, (mine, hf_token) in enumerate(zip(ours, theirs, strict=True)):
            if mine != hf_token:
                assert mine in their_top5[step], (family, step, ours, theirs)
                assert hf_token in our_logprobs[step], (family, step, ours, theirs)
                break

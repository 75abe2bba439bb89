"""The bf16 parity rule against transformers, shared by the CPU and GPU tests.

bf16 rounding differs between any two implementations, so greedy tokens must equal
transformers', or at the first divergence each side's token must be in the other's top 5 (the
comparison stops there).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from cluster import LLM, SamplingParams
from tests.helpers.tiny_gemma4_gpt_oss import GEMMA4, GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import save_tiny_model

PROMPTS = [[(7 * i + 3) % 256 for i in range(30)], [(13 * i + 1) % 256 for i in range(17)]]
NUM_NEW = 16
TOP_K = 5
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


def transformers_greedy(
    hf_model: torch.nn.Module, prompt: list[int], device: str
) -> tuple[list[int], list[list[int]]]:
    """transformers' greedy tokens and, per step, its top-5 token IDs."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=NUM_NEW,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    top = [scores[0].topk(TOP_K).indices.tolist() for scores in out.scores]
    return out.sequences[0, len(prompt) :].tolist(), top


def assert_bf16_parity(family: str, path: Path, device: str, **llm_args: object) -> None:
    """Save `family`'s tiny model at `path`; our bf16 greedy tokens follow transformers' bf16
    ones on `device` by the rule above."""
    hf_model = SAVERS[family](path).to(device, torch.bfloat16)
    llm = LLM(str(path), device=device, dtype="bfloat16", **llm_args)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=TOP_K)
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    model = llm.client.core.executor.worker.model_runner.model  # in-process, tp_size 1
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    llm.shutdown()
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    for prompt, result in zip(PROMPTS, results, strict=True):
        theirs, their_top = transformers_greedy(hf_model, prompt, device)
        ours, our_logprobs = result.outputs[0].token_ids, result.outputs[0].logprobs
        assert our_logprobs is not None
        for step, (mine, hf_token) in enumerate(zip(ours, theirs, strict=True)):
            if mine != hf_token:
                assert mine in their_top[step], (family, step, ours, theirs)
                assert hf_token in our_logprobs[step], (family, step, ours, theirs)
                break

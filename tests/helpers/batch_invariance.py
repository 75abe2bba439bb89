"""One prompt's token logprobs under the cases the batch-invariant mode must not notice: alone,
after a prefix hit, in a batch of 8, with its prefill cut into chunks, and with speculation
(every draft accepted). Shared by the CPU and the CUDA tests of the mode.

Models: gpt-oss (full attention, sliding window with sinks, MoE), Nemotron-H (Mamba-2),
Qwen3-Next (gated DeltaNet, MoE) and LFM2 (short convolution); each has full attention layers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cluster import LLM, SamplingParams
from tests.helpers.drafters import ScriptedProposer, install_proposer
from tests.helpers.engine_probe import engine_stats
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

MODELS = ["gpt_oss", "nemotron_h", "qwen3_next", "lfm2"]
PROMPT = [(7 * i + 3) % 256 for i in range(37)]
OTHERS = [[(11 * i + 5 * j + 1) % 256 for i in range(5 + 4 * j)] for j in range(7)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
ENGINE = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 1 << 22}
CHUNKED = {"max_num_batched_tokens": 9, "enable_prefix_caching": False}
NUM_DRAFTS = 3


def save_model(family: str, path: Path) -> None:
    """The tiny random checkpoint of `family` (one of MODELS)."""
    if family == "gpt_oss":
        save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, path)
    elif family == "nemotron_h":
        save_tiny_hybrid(family, path)
    else:
        save_tiny_linear_hybrid(family, path)


def generate(llm: LLM, prompts: list[list[int]], index: int = 0) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of `prompts[index]` and their logprobs (as reported)."""
    completion = llm.generate(prompts, PARAMS, use_tqdm=False)[index].outputs[0]
    tokens = list(completion.token_ids)
    entries = zip(tokens, completion.logprobs, strict=True)
    return tokens, torch.tensor([entry[token].logprob for token, entry in entries])


def in_batch(llm: LLM) -> tuple[list[int], torch.Tensor]:
    """PROMPT's tokens and logprobs as the 4th of 8 prompts."""
    return generate(llm, [*OTHERS[:3], PROMPT, *OTHERS[3:]], index=3)


def invariance_cases(path: Path, **engine: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PROMPT's logprobs alone (fresh cache, whole prefill), and per case."""
    llm = LLM(str(path), **ENGINE, **engine)  # type: ignore[arg-type]
    tokens, alone = generate(llm, [PROMPT])
    hits_before = engine_stats(llm).prefix_cache_hit_tokens
    cases = {"prefix hit": generate(llm, [PROMPT])[1]}
    assert engine_stats(llm).prefix_cache_hit_tokens > hits_before
    llm.reset_prefix_cache()
    cases["batch of 8"] = in_batch(llm)[1]
    llm.shutdown()
    spec = {"method": "ngram", "num_speculative_tokens": NUM_DRAFTS}
    llm = LLM(str(path), speculative_config=spec, **ENGINE, **CHUNKED, **engine)  # type: ignore[arg-type]
    cases["chunked prefill"] = generate(llm, [PROMPT])[1]
    install_proposer(llm, ScriptedProposer(NUM_DRAFTS, [PROMPT + tokens], "oracle"))
    drafted = engine_stats(llm).spec_decoding
    cases["speculation"] = generate(llm, [PROMPT])[1]
    after = engine_stats(llm).spec_decoding
    llm.shutdown()
    assert drafted is not None
    assert after is not None
    assert after.num_accepted_tokens > drafted.num_accepted_tokens  # the drafts were verified
    return alone, cases

"""Sleep -> (update) -> wake -> generate cycles on an engine, each checked against the greedy tokens
and logprobs the engine gave before its first sleep (or, after an update, against what the
update's caller expects)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cluster import LLM, SamplingParams
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.tiny_mtp import save_tiny_with_mtp

Outputs = list[tuple[list[int], list[float]]]
"""Per prompt: greedy token IDs and the logprob of each."""

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 11], [40, 2, 19, 6, 6, 23, 8, 1, 30, 12, 4]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "max_model_len": 64,
    "max_num_batched_tokens": 32,
    "kv_cache_memory_bytes": 1 << 21,
    "enable_prefix_caching": True,
    "kv_offloading_size": 0.01,
}
SELF_DRAFT = {"method": "draft_model", "num_speculative_tokens": 2}
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def save_layout(family: str, path: Path) -> dict[str, Any]:
    """Save a tiny `family` checkpoint at `path`; its speculative_config (MTP for Qwen3.5, the
    model drafting for itself otherwise)."""
    if family == "qwen3_5":
        save_tiny_with_mtp("qwen3_5", path)
        return MTP
    if family == "nemotron_h":
        save_tiny_hybrid("nemotron_h", path)
    elif family == "gpt_oss":
        save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, path)
    else:
        save_tiny_model(family, path, max_position_embeddings=128)
    return {**SELF_DRAFT, "model": str(path)}


def rss_bytes() -> int:
    """This process's resident memory."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def generate(llm: LLM, prompts: Sequence[list[int]] = PROMPTS) -> Outputs:
    outputs = llm.generate([list(p) for p in prompts], PARAMS, use_tqdm=False)
    return [_tokens_and_logprobs(output.outputs[0]) for output in outputs]


def _tokens_and_logprobs(completion: Any) -> tuple[list[int], list[float]]:
    tokens = list(completion.token_ids)
    logprobs = [
        entry[token].logprob for token, entry in zip(tokens, completion.logprobs, strict=True)
    ]
    return tokens, logprobs


def run_cycles(
    llm: LLM,
    num_cycles: int,
    update: Callable[[LLM, int], Outputs | None] | None = None,
    levels: Sequence[int] = (1, 2),
) -> int:
    """`num_cycles` of sleep (levels in turn, mode abort) -> wake the weights -> `update(llm,
    cycle)` -> wake the rest -> generate, as an RL loop does; each generation asserted equal
    (bit for bit) to the expected outputs: those before the first sleep, or the ones the last
    update returned. Returns the cycles run.

    A sleep forgets the prefix cache, so the outputs before it are taken with the cache reset
    too (a prefix hit may round a recurrent state's logprobs differently from a cold prefill).
    """
    assert llm.reset_prefix_cache()
    expected = generate(llm)
    for cycle in range(num_cycles):
        llm.sleep(level=levels[cycle % len(levels)])
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()  # the KV cache is still asleep: no step runs
        updated = update(llm, cycle) if update is not None else None
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        expected = updated if updated is not None else expected
        got = generate(llm)
        assert got == expected, f"cycle {cycle}: {got} != {expected}"
    return num_cycles

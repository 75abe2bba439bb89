"""One prompt's token logprobs under the cases the batch-invariant mode must not notice: alone,
after a prefix hit, in a batch of 8, with its prefill cut into chunks, and with speculation
(every draft accepted). Shared by the CPU and the CUDA tests of the mode.

Models: gpt-oss (full attention, sliding window with sinks, MoE), Nemotron-H (Mamba-2),
Qwen3-Next (gated DeltaNet, MoE) and LFM2 (short convolution); each has full attention layers.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from cluster import LLM, SamplingParams
from kernels.batch_invariant import POINTWISE, WEIGHT_PRODUCTS
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


_INVARIANT_OPS = ("invariant_linear", "whole_vectors")
"""The batch-invariant operations (`kernels.batch_invariant`), whose own torch calls are fine."""


class EscapeDetector(TorchFunctionMode):
    """Counts the batch-dependent torch calls made outside the batch-invariant operations: a
    product against a weight matrix, or a transcendental pointwise function of a per-token
    tensor (two or more dimensions), by the file and line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.escapes: Counter[str] = Counter()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if _is_batch_dependent(func, args):
            caller = _caller()
            if not _in_invariant_op(caller):
                where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
                self.escapes[f"{func.__name__} at {where}"] += 1
        return func(*args, **(kwargs or {}))


def _is_batch_dependent(func: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    tensors = [arg for arg in args[:2] if isinstance(arg, torch.Tensor)]
    if not tensors or not tensors[0].is_floating_point():
        return False
    if func in WEIGHT_PRODUCTS:
        return len(tensors) == 2 and tensors[0].dim() >= 2 and 2 in (t.dim() for t in tensors)
    return func in POINTWISE and tensors[0].dim() >= 2


def _in_invariant_op(frame: Any) -> bool:
    """Whether `frame` runs in one of the invariant operations (or a comprehension in one)."""
    filename = frame.f_code.co_filename
    while frame is not None and frame.f_code.co_filename == filename:
        if frame.f_code.co_name in _INVARIANT_OPS:
            return True
        frame = frame.f_back
    return False


def _caller() -> Any:
    """The first frame outside torch and this module (the code that made the call)."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (
        "/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return frame

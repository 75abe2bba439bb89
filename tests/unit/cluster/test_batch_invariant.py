"""Batch-invariant mode: one prompt's token logprobs are bit-identical alone, in a batch of 7
others, after a prefix hit, with its prefill cut into chunks and with speculation (every draft
accepted), on every group type; without the mode they are not (CPU fp32, tiny random models,
the offline `LLM`).

Models: gpt-oss (full attention, sliding window with sinks, MoE), Nemotron-H (Mamba-2),
Qwen3-Next (gated DeltaNet, MoE) and LFM2 (short convolution); each has full attention layers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
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


@pytest.fixture(scope="module", params=MODELS)
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss":
        save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, path)
    elif request.param == "nemotron_h":
        save_tiny_hybrid(request.param, path)
    else:
        save_tiny_linear_hybrid(request.param, path)
    return path


def _generate(llm: LLM, prompts: list[list[int]], index: int = 0) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of `prompts[index]` and their logprobs (float64 of the reported values)."""
    completion = llm.generate(prompts, PARAMS, use_tqdm=False)[index].outputs[0]
    tokens = list(completion.token_ids)
    entries = zip(tokens, completion.logprobs, strict=True)
    return tokens, torch.tensor([entry[token].logprob for token, entry in entries])


def _in_batch(llm: LLM) -> tuple[list[int], torch.Tensor]:
    return _generate(llm, [*OTHERS[:3], PROMPT, *OTHERS[3:]], index=3)


def test_logprobs_bit_identical_in_batch_invariant_mode(model_path: Path) -> None:
    llm = LLM(str(model_path), batch_invariant=True, **ENGINE)
    tokens, alone = _generate(llm, [PROMPT])
    hits_before = engine_stats(llm).prefix_cache_hit_tokens
    cases = {"prefix hit": _generate(llm, [PROMPT])[1]}
    assert engine_stats(llm).prefix_cache_hit_tokens > hits_before
    llm.reset_prefix_cache()
    cases["batch of 8"] = _in_batch(llm)[1]
    llm.shutdown()
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(model_path), batch_invariant=True, speculative_config=spec, **ENGINE, **CHUNKED)
    cases["chunked prefill"] = _generate(llm, [PROMPT])[1]
    install_proposer(llm, ScriptedProposer(3, [PROMPT + tokens], "oracle"))
    drafted = engine_stats(llm).spec_decoding
    cases["speculation"] = _generate(llm, [PROMPT])[1]
    after = engine_stats(llm).spec_decoding
    llm.shutdown()
    assert drafted is not None
    assert after is not None
    assert after.num_accepted_tokens > drafted.num_accepted_tokens  # the drafts were verified
    for case, logprobs in cases.items():
        assert torch.equal(logprobs, alone), f"{case}: {(logprobs - alone).tolist()}"


def test_logprobs_differ_in_a_batch_without_the_mode(model_path: Path) -> None:
    llm = LLM(str(model_path), enable_prefix_caching=False, **ENGINE)
    tokens, alone = _generate(llm, [PROMPT])
    batch_tokens, in_batch = _in_batch(llm)
    llm.shutdown()
    assert batch_tokens == tokens
    assert not torch.equal(in_batch, alone)

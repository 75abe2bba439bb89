"""Hybrid KV cache paths through real models and the real runner, against transformers (CPU fp32).

Prefix-cache hits on sliding-window + full models (Gemma 2, Gemma 3, Qwen 2), on an all-window
model (Mistral) and on chunked local attention (Llama 4), with the hybrid KV cache manager on and
off; preemption of requests that already generated tokens; the engine-level sampling seed; and a
step that fails in the middle of `generate`. Greedy tokens must equal transformers' `generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.helpers.engine_probe import engine_stats, failing_forward, watch_preemptions
from tests.helpers.tiny_models import hf_greedy, save_tiny_model

pytestmark = pytest.mark.parity

LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 1 << 22,
}
PROMPT = [(7 * i + 3) % 256 for i in range(30)]
# Share 16 and 24 leading tokens (4 and 6 blocks of 4, past the window of 6 and chunks of 8).
SHARING = [[*PROMPT[:16], 9, 8, 7, 6, 5], [*PROMPT[:24], 200, 100, 50]]
NUM_NEW = 8
# Hybrid manager: KV cache groups per family (window and full, or chunked and full layers
# in separate groups); off: one group.
HYBRID_GROUPS = {"gemma2": 2, "gemma3": 4, "qwen2": 2, "mistral": 1, "llama4": 2}


def _hf_greedy(hf_model: torch.nn.Module, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    return hf_greedy(hf_model, prompt, num_new)


def _tokens(results) -> list[list[int]]:
    return [result.outputs[0].token_ids for result in results]


def _hf_logprobs(hf_model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probability of each generated token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].double()
    rows = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return [float(rows[step, token]) for step, token in enumerate(tokens)]


def _assert_logprobs_match(hf_model: torch.nn.Module, prompts: list[list[int]], results) -> None:
    """Each sampled token's log-probability is transformers' (a stale KV read shows here even
    when the argmax survives it)."""
    for prompt, result in zip(prompts, results, strict=True):
        tokens = result.outputs[0].token_ids
        positions = result.outputs[0].logprobs
        logprobs = [
            position[token].logprob for position, token in zip(positions, tokens, strict=True)
        ]
        assert logprobs == pytest.approx(_hf_logprobs(hf_model, prompt, tokens), abs=1e-4)


@pytest.fixture(scope="module", params=sorted(HYBRID_GROUPS))
def saved(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny_model(request.param, path)


@pytest.mark.parametrize("disable_hybrid", [False, True], ids=["hybrid", "one-group"])
def test_prefix_cache_hits_give_transformers_tokens(saved, disable_hybrid: bool) -> None:
    """A finished prompt's blocks serve later prompts sharing 16 and 24 tokens (and itself);
    every group (window, chunk, full) must agree on the hit, and the tokens stay exact."""
    family, path, hf_model = saved
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=0)
    llm = LLM(str(path), disable_hybrid_kv_cache_manager=disable_hybrid, **LLM_ARGS)
    try:
        assert len(llm.client.core.scheduler.kv_cache_config.groups) == (
            1 if disable_hybrid else HYBRID_GROUPS[family]
        )
        (first,) = llm.generate([PROMPT], params, use_tqdm=False)
        assert first.num_cached_tokens == 0
        results = llm.generate([*SHARING, PROMPT], params, use_tqdm=False)
        assert engine_stats(llm).kv_cache_usage == 0
    finally:
        llm.shutdown()
    prompts = [PROMPT, *SHARING, PROMPT]
    assert _tokens([first, *results]) == [_hf_greedy(hf_model, p) for p in prompts]
    # Every hit ends on a block boundary, inside the shared part, and leaves one token to compute.
    assert [r.num_cached_tokens for r in results] == [16, 24, 28]
    _assert_logprobs_match(hf_model, prompts, [first, *results])


# Short prompts (all prefilled in the first step) and long outputs: the pool runs out while the
# requests decode, so every victim has generated tokens. 48 KiB: 12 blocks of four 1 KiB layer
# pages; a request of max_model_len 40 needs 10 of them (the hybrid manager splits the bytes
# between its two groups).
DECODE_PROMPTS = [[(k * i + k) % 256 for i in range(6)] for k in (3, 5, 7)]
NUM_LONG = 26
SMALL_POOL = {"block_size": 4, "max_num_batched_tokens": 32, "kv_cache_memory_bytes": 12 << 12}


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # full attention; window + full groups
def test_requests_preempted_after_generating_resume_with_the_same_tokens(
    family: str, tmp_path: Path
) -> None:
    """Greedy: transformers' tokens; seeded sampling: what each request draws alone. Both with
    victims that had generated tokens (recompute of prompt + outputs, then the generator's
    draws continue where they stopped)."""
    hf_model = save_tiny_model(family, tmp_path)
    llm = LLM(str(tmp_path), max_model_len=40, **SMALL_POOL)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_LONG)
    seeded = [
        SamplingParams(temperature=1.0, top_k=50, max_tokens=NUM_LONG, seed=seed)
        for seed in (11, 12, 13)
    ]
    try:
        with watch_preemptions(llm) as greedy_victims:
            greedy_results = llm.generate(DECODE_PROMPTS, greedy, use_tqdm=False)
        alone = [
            _tokens(llm.generate([prompt], params, use_tqdm=False))[0]
            for prompt, params in zip(DECODE_PROMPTS, seeded, strict=True)
        ]
        with watch_preemptions(llm) as seeded_victims:
            seeded_results = llm.generate(DECODE_PROMPTS, seeded, use_tqdm=False)
        assert engine_stats(llm).kv_cache_usage == 0
    finally:
        llm.shutdown()
    for victims in (greedy_victims, seeded_victims):
        assert victims, "no request was preempted"
        assert all(num_outputs > 0 for num_outputs in victims)
    assert _tokens(greedy_results) == [_hf_greedy(hf_model, p, NUM_LONG) for p in DECODE_PROMPTS]
    assert _tokens(seeded_results) == alone


def test_engine_seed_fixes_unseeded_sampling_and_leaves_seeded_requests_alone(
    tmp_path: Path,
) -> None:
    """Two engines with one `seed` draw the same tokens for requests without a seed; another
    engine seed draws others; a request's own seed gives the same draws under any engine seed."""
    save_tiny_model("gemma2", tmp_path)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12)
    own_seed = SamplingParams(temperature=1.0, max_tokens=12, seed=77)
    prompts = [PROMPT, SHARING[0], SHARING[1]]
    runs = []
    for engine_seed in (3, 3, 4):
        llm = LLM(str(tmp_path), seed=engine_seed, **LLM_ARGS)
        try:
            runs.append(
                (
                    _tokens(llm.generate(prompts, unseeded, use_tqdm=False)),
                    _tokens(llm.generate(prompts, own_seed, use_tqdm=False)),
                )
            )
        finally:
            llm.shutdown()
    assert runs[0] == runs[1]
    assert all(a != b for a, b in zip(runs[0][0], runs[2][0], strict=True))
    assert runs[0][1] == runs[2][1]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_step_failing_mid_generate_leaves_no_blocks_and_the_next_call_is_exact(
    family: str, tmp_path: Path
) -> None:
    """tp_size 1: the model raises in the third forward pass (blocks of that step were already
    registered in the prefix cache, their KV never written); the error reaches the caller,
    nothing stays queued or holds a block, and the same call then gives transformers' tokens
    and log-probabilities (no hit on a block the failed step left unwritten)."""
    hf_model = save_tiny_model(family, tmp_path)
    prompts = [PROMPT, *SHARING]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=0)
    llm = LLM(str(tmp_path), **LLM_ARGS)
    try:
        with (
            failing_forward(llm, 3, RuntimeError("injected")),
            pytest.raises(RuntimeError, match="injected"),
        ):
            llm.generate(prompts, params, use_tqdm=False)
        stats = engine_stats(llm)
        assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
        assert stats.kv_cache_usage == 0
        results = llm.generate(prompts, params, use_tqdm=False)
        assert engine_stats(llm).kv_cache_usage == 0
    finally:
        llm.shutdown()
    assert _tokens(results) == [_hf_greedy(hf_model, p) for p in prompts]
    assert any(r.num_cached_tokens for r in results)  # the cache is still used after a failure
    _assert_logprobs_match(hf_model, prompts, results)

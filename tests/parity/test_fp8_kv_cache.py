"""The fp8 KV cache end to end: the offline `LLM` with kv_cache_dtype fp8 against "auto" (CPU fp32).

Tiny random models (transformers-built, as the other parity tests) on 8 prompts x 16 greedy
tokens. Their logits are nearly flat (near-ties at every step), and one flipped token changes
the rest of its answer, so agreement is counted on the same tokens (as the bf16 parity rule
does): "auto"'s greedy answers are fed to the fp8 engine as prompts, and at each of the 128
answer positions fp8's greedy choice (its prompt logprob of rank 1) must be "auto"'s token
for at least MIN_SHARE of them (measured shares in each test). Prefix-cache hits are those of
"auto", and a hit
gives the tokens of the first run; ngram speculation does not change fp8 outputs; computed
scales (calculate_kv_scales) serve Gemma 4's K = V and KV-sharing layers; a model without
attention layers refuses an fp8 kv_cache_dtype at start-up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.helpers.engine_probe import engine_stats
from tests.helpers.tiny_gemma4_gpt_oss import GEMMA4, GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import save_tiny_model
from worker.attention.attention import Attention

pytestmark = pytest.mark.parity

NUM_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
PROMPTS = [[(7 * i + 13 * j + 3) % 256 for i in range(9 + 3 * j)] for j in range(8)]
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 64,
    "kv_cache_memory_bytes": 1 << 21,
}
MIN_SHARE = {"llama": 0.9, "gpt_oss": 0.75, "bamba": 0.9, "gemma4": 0.5}
"""Least share of "auto"'s 128 greedy tokens that fp8 picks on the same context, per model."""
MIN_FREE = {"llama": 0.6, "gpt_oss": 0.25, "bamba": 0.6, "gemma4": 0.0}
"""Least share of equal tokens running freely (what decodes are checked by; Gemma 4's flat
logits leave nothing to assert)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny checkpoints, each saved once for the module."""
    paths = {name: tmp_path_factory.mktemp(name) for name in MIN_SHARE}
    save_tiny_model("llama", paths["llama"])
    save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, paths["gpt_oss"])
    save_gemma4_or_gpt_oss("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4, paths["gemma4"])
    save_tiny_hybrid("bamba", paths["bamba"])
    return paths


@pytest.fixture(scope="module")
def auto_tokens(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    """Greedy tokens of PROMPTS with the model-dtype KV cache, per model."""
    return {name: _generate(path, PROMPTS) for name, path in checkpoints.items()}


FP8_CALCULATED = {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}
"""Scales from each layer's first batch: far from 1, so a path that forgot them would show."""


@pytest.fixture(scope="module")
def llama_fp8(checkpoints: dict[str, Path]) -> Iterator[LLM]:
    llm = LLM(str(checkpoints["llama"]), **FP8_CALCULATED, **LLM_ARGS)
    yield llm
    llm.shutdown()


def _generate(path: Path, prompts: list[list[int]], **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), **LLM_ARGS, **kwargs)
    try:
        return _tokens(llm, prompts)
    finally:
        llm.shutdown()


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _share_identical(got: list[list[int]], want: list[list[int]]) -> float:
    """Share of equal tokens position by position (free running: reported, not asserted)."""
    pairs = [(a, b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def _agreement(llm: LLM, answers: list[list[int]]) -> float:
    """Share of the `answers` to PROMPTS that `llm` picks greedily given the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    full = [[*prompt, *answer] for prompt, answer in zip(PROMPTS, answers, strict=True)]
    results = llm.generate(full, params, use_tqdm=False)
    agree = total = 0
    for prompt, answer, result in zip(PROMPTS, answers, results, strict=True):
        for offset, token in enumerate(answer):
            position = result.prompt_logprobs[len(prompt) + offset]
            best = [t for t, entry in position.items() if entry.rank == 1]
            agree += best == [token]
            total += 1
    return agree / total


def _report(llm: LLM, name: str, auto: list[list[int]]) -> tuple[float, float]:
    """Agreement with "auto" on the same tokens (prefill kernels) and free running (decodes)."""
    share = _agreement(llm, auto)
    free = _share_identical(_tokens(llm, PROMPTS), auto)
    print(f"{name}: {share:.3f} of auto's greedy tokens picked on their context, {free:.2f} free")
    return share, free


def _attention_layers(llm: LLM) -> list[Attention]:
    model = llm.client.core.executor.worker.model_runner.model
    return [module for module in model.modules() if isinstance(module, Attention)]


def test_llama_fp8_pages_agree_with_auto_and_are_one_byte(
    llama_fp8: LLM, auto_tokens: dict[str, list[list[int]]]
) -> None:
    """Measured: 0.984 (e4m3, calculated scales; free running 0.85)."""
    runner = llama_fp8.client.core.executor.worker.model_runner
    assert all(spec.dtype_bytes == 1 for spec in runner.kv_cache_specs().layer_specs.values())
    assert {cache.dtype for caches in runner.kv_caches.values() for cache in caches} == {
        torch.float8_e4m3fn
    }
    share, free = _report(llama_fp8, "llama fp8", auto_tokens["llama"])
    assert share >= MIN_SHARE["llama"]
    assert free >= MIN_FREE["llama"]
    assert all(
        0 < float(scale) < 1 for layer in _attention_layers(llama_fp8) for scale in layer.kv_scales
    )


@pytest.mark.parametrize(("model", "kv_cache_dtype"), [("gpt_oss", "fp8"), ("bamba", "fp8_e5m2")])
def test_fp8_agrees_with_auto_on_sinks_windows_and_mamba_hybrids(
    model: str,
    kv_cache_dtype: str,
    checkpoints: dict[str, Path],
    auto_tokens: dict[str, list[list[int]]],
) -> None:
    """Scales 1.0 (no checkpoint scales): gpt-oss (sinks, sliding window; e4m3) measured 0.859
    (free running 0.43); Bamba (Mamba-2 beside attention, its state pages kept float32; e5m2)
    0.984 (free 0.80)."""
    llm = LLM(str(checkpoints[model]), kv_cache_dtype=kv_cache_dtype, **LLM_ARGS)
    try:
        share, free = _report(llm, f"{model} {kv_cache_dtype}", auto_tokens[model])
        caches = llm.client.core.executor.worker.model_runner.kv_caches
        dtypes = {cache.dtype for layer_caches in caches.values() for cache in layer_caches}
    finally:
        llm.shutdown()
    assert share >= MIN_SHARE[model]
    assert free >= MIN_FREE[model]
    fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    assert dtypes == ({fp8, torch.float32} if model == "bamba" else {fp8})


def test_prefix_hits_with_fp8_equal_auto_and_give_the_first_run_tokens(
    llama_fp8: LLM, checkpoints: dict[str, Path]
) -> None:
    prompt = [(5 * i + 1) % 256 for i in range(22)]
    first, second = (llama_fp8.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2))
    auto = LLM(str(checkpoints["llama"]), **LLM_ARGS)
    try:
        auto_runs = [auto.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2)]
    finally:
        auto.shutdown()
    assert second.num_cached_tokens > 0
    assert second.num_cached_tokens == auto_runs[1].num_cached_tokens
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_ngram_speculation_keeps_the_fp8_outputs(
    llama_fp8: LLM, checkpoints: dict[str, Path]
) -> None:
    repetitive = [[*p[:6]] * 3 for p in PROMPTS[:4]]  # ngram drafts find matches
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(str(checkpoints["llama"]), **FP8_CALCULATED, speculative_config=spec, **LLM_ARGS)
    try:
        speculative = _tokens(llm, repetitive)
        counters = engine_stats(llm).spec_decoding
    finally:
        llm.shutdown()
    assert counters is not None
    assert counters.num_accepted_tokens > 0, "no draft was accepted: nothing was checked"
    assert speculative == _tokens(llama_fp8, repetitive)


def test_calculated_scales_serve_keys_from_values_and_sharing_layers(
    checkpoints: dict[str, Path], auto_tokens: dict[str, list[list[int]]]
) -> None:
    """Gemma 4: scales from the first stored batch, fixed from then on; the KV-sharing layers
    read their target's (K = V layers: the value scale for both). Measured 0.617 (free running
    0.09: its logits are the flattest of the tiny models; bf16 alone gives it 0.85)."""
    model = "gemma4"
    llm = LLM(str(checkpoints[model]), **FP8_CALCULATED, **LLM_ARGS)
    try:
        _tokens(llm, PROMPTS[:1])  # the first batch sets the scales
        layers = _attention_layers(llm)
        scales = [(float(layer.k_scale), float(layer.v_scale)) for layer in layers]
        share, _ = _report(llm, f"{model} calculated scales", auto_tokens[model])
        assert scales == [(float(layer.k_scale), float(layer.v_scale)) for layer in layers]
    finally:
        llm.shutdown()
    assert all(0 < scale < 1 for pair in scales for scale in pair), scales
    by_name = {layer.layer_name: layer for layer in layers}
    for layer in layers:
        target = layer.config.kv_sharing_target
        if target is not None:
            assert layer.kv_scales == by_name[target].kv_scales
    assert share >= MIN_SHARE[model]


def test_fp8_kv_cache_on_a_model_without_attention_layers_fails_at_start(tmp_path: Path) -> None:
    save_tiny_hybrid("bamba", tmp_path, attn_layer_indices=[])
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 applies to attention KV pages"):
        LLM(str(tmp_path), kv_cache_dtype="fp8", **LLM_ARGS)


def test_tensor_parallel_ranks_calculate_one_scale_and_give_the_single_rank_tokens(
    checkpoints: dict[str, Path],
) -> None:
    """Two ranks each hold half the KV heads; the scale each calculates from its first batch
    is the maximum over both, so the pages (and tokens) are those of one rank holding all."""
    single = _generate(checkpoints["llama"], PROMPTS, **FP8_CALCULATED)
    split = _generate(checkpoints["llama"], PROMPTS, tensor_parallel_size=2, **FP8_CALCULATED)
    assert split == single

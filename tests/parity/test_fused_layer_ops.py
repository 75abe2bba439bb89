"""The fused decoder layer: operations per layer per decode step stay under each family's bound
(a regression to unfused norms, rotary, activations, projections or the gated DeltaNet's decode
step fails), and q/k/v and
gate/up projections fused at load from a split checkpoint give transformers' greedy tokens.

Counted as `benchmarks/bench_layer_ops.py` does (torch dispatches other than views, in-process,
synchronous steps, 8 requests decoding together, fp32 tiny models).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors import safe_open

from cluster import LLM, SamplingParams
from tests.helpers.tiny_models import hf_greedy, save_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_layer_ops import FAMILIES, LLM_ARGS, decode_prompts, decoder_layers, measure

pytestmark = pytest.mark.parity

MAX_OPS_PER_LAYER = {"llama": 36, "gemma3": 57, "qwen3_5": 51}
"""Bounds on dispatches per decoder layer per decode step (unfused: 75, 112 and 148; before
the per-step decode gather plan: 58, 72 and 131; before Gemma norms folded `1 + w` at load and
the gated DeltaNet decoded in one fused step: 36, 64 and 131)."""


@pytest.fixture(scope="module", params=sorted(MAX_OPS_PER_LAYER))
def family_llm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LLM]]:
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param](path)
    llm = LLM(str(path), **LLM_ARGS)
    yield request.param, llm
    llm.shutdown()


def test_decode_ops_per_layer_stay_under_the_family_bound(family_llm: tuple[str, LLM]) -> None:
    family, llm = family_llm
    counts = measure(llm)
    assert len(counts.step_totals) >= 3, "decode steps of all 8 requests were not seen"
    assert counts.per_layer() <= MAX_OPS_PER_LAYER[family], counts.breakdown()


def test_split_checkpoint_loads_fused_projections_with_transformers_tokens(
    tmp_path: Path,
) -> None:
    hf_model = save_tiny_model("llama", tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    split = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert all(f"model.layers.0.self_attn.{n}.weight" in names for n in split[:3])
    assert all(f"model.layers.0.mlp.{n}.weight" in names for n in split[3:])
    llm = LLM(str(tmp_path), **LLM_ARGS)
    try:
        layer = decoder_layers(llm)[0]
        modules = dict(layer.named_modules())
        assert "self_attn.qkv_proj" in modules
        assert "mlp.gate_up_proj" in modules
        assert not any(name.rpartition(".")[2] in split for name in modules)
        counts = measure(llm)
        # One GEMM for q/k/v, one for gate/up, plus o_proj and down_proj.
        assert counts.ops["linear"] == 4 * counts.num_layers * len(counts.step_totals)
        prompts = decode_prompts()
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == [hf_greedy(hf_model, prompt, 8) for prompt in prompts]

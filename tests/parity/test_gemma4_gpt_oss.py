"""Gemma 4 text and gpt-oss against transformers (CPU fp32), through the paged driver and the
offline `LLM` (chunked prefill with block size 4 and a 24-token budget).

Prefill logits must match transformers within 1e-4 and 32 greedy tokens must equal its
`generate`: with prefix-cache hits, the hybrid KV cache manager on and off, truncated prefill
on and off (Gemma 4's KV-sharing layers) and tensor parallelism 2. The tiny Gemma 4 has global
layers with a larger head (64 vs 16), K = V (one cached tensor, keys rebuilt by the kernel), so
its two layer types have different page sizes, two KV-sharing layers (one of them reading a
K = V cache) and, in one variant, MoE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from cluster import LLM, SamplingParams
from kernels import HAS_TRITON
from scheduler.kv_cache.spec import UniformTypeKVCacheSpecs
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.tiny_gemma4_gpt_oss import (
    GEMMA4,
    GEMMA4_MOE,
    GEMMA4_PLAIN,
    GPT_OSS,
    save_gemma4_or_gpt_oss,
)
from tests.helpers.tiny_models import hf_greedy, load_our_model
from worker.models.decoder import attention_layer_name

pytestmark = pytest.mark.parity

PROMPTS = [
    [(7 * i + 3) % 256 for i in range(30)],
    [(11 * i + 5) % 256 for i in range(5)],
    [(13 * i + 1) % 256 for i in range(17)],
]
# Share 16 and 24 leading tokens with the first prompt: prefix-cache hits once it has run.
PREFIX_PROMPTS = [[*PROMPTS[0][:16], 9, 8, 7, 6, 5], [*PROMPTS[0][:24], 200, 100, 50]]
NUM_NEW = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 24,
    "kv_cache_memory_bytes": 1 << 22,
}


class Saved(NamedTuple):
    """A saved tiny model, its transformers twin and the twin's greedy tokens."""

    path: Path
    hf_model: torch.nn.Module
    greedy: list[list[int]]
    """For PROMPTS, then PREFIX_PROMPTS."""


def _save(config_cls: str, model_cls: str, kwargs: dict, path: Path) -> Saved:
    model = save_gemma4_or_gpt_oss(config_cls, model_cls, kwargs, path)
    greedy = [hf_greedy(model, prompt, NUM_NEW) for prompt in PROMPTS + PREFIX_PROMPTS]
    return Saved(path, model, greedy)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> Saved:
    return _save("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4, tmp_path_factory.mktemp("g4"))


@pytest.fixture(scope="module")
def gemma4_moe(tmp_path_factory) -> Saved:
    path = tmp_path_factory.mktemp("g4moe")
    return _save("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_MOE, path)


@pytest.fixture(scope="module")
def gemma4_plain(tmp_path_factory) -> Saved:
    path = tmp_path_factory.mktemp("g4plain")
    return _save("Gemma4TextConfig", "Gemma4ForCausalLM", GEMMA4_PLAIN, path)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Saved:
    return _save("GptOssConfig", "GptOssForCausalLM", GPT_OSS, tmp_path_factory.mktemp("oss"))


def _generate(saved: Saved, **kwargs) -> tuple[list[list[int]], list[int]]:
    """Greedy tokens of PROMPTS and then PREFIX_PROMPTS, and the latter's cached tokens."""
    llm = LLM(str(saved.path), **LLM_ARGS, **kwargs)
    try:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        second = llm.generate(PREFIX_PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [r.outputs[0].token_ids for r in first + second]
    return tokens, [r.num_cached_tokens for r in second]


@pytest.mark.parametrize("name", ["gemma4", "gemma4_moe", "gemma4_plain", "gpt_oss"])
def test_prefill_logits_match_transformers(name, request):
    saved = request.getfixturevalue(name)
    prompt = PROMPTS[0]
    with torch.no_grad():
        expected = saved.hf_model(torch.tensor([prompt])).logits[0]
    got = PagedDriver(load_our_model(saved.path), block_size=4).step({"r": prompt})["r"]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("fast_prefill", "disable_hybrid"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_gemma4_greedy_tokens_and_prefix_hits_match_transformers(
    gemma4, fast_prefill, disable_hybrid
):
    tokens, cached = _generate(
        gemma4,
        kv_sharing_fast_prefill=fast_prefill,
        disable_hybrid_kv_cache_manager=disable_hybrid,
    )
    assert tokens == gemma4.greedy
    assert all(num > 0 for num in cached)


@pytest.mark.parametrize("name", ["gemma4_moe", "gemma4_plain"])
def test_gemma4_variants_greedy_tokens_and_prefix_hits_match_transformers(name, request):
    saved = request.getfixturevalue(name)
    tokens, cached = _generate(saved, kv_sharing_fast_prefill=True)
    assert tokens == saved.greedy
    assert all(num > 0 for num in cached)


@pytest.mark.parametrize("disable_hybrid", [False, True])
def test_gpt_oss_greedy_tokens_and_prefix_hits_match_transformers(gpt_oss, disable_hybrid):
    tokens, cached = _generate(gpt_oss, disable_hybrid_kv_cache_manager=disable_hybrid)
    assert tokens == gpt_oss.greedy
    assert all(num > 0 for num in cached)


def test_gemma4_kv_groups_unify_page_sizes_and_fold_when_hybrid_is_off(gemma4):
    """Global layers cache V alone (K = V): 64 features per token, twice the sliding layers'
    K and V of 16 features, so the sliding group's block size doubles."""
    configs = {}
    for hybrid_off in (False, True):
        llm = LLM(str(gemma4.path), **LLM_ARGS, disable_hybrid_kv_cache_manager=hybrid_off)
        configs[hybrid_off] = llm.client.core.scheduler.kv_cache_config
        llm.shutdown()
    hybrid = configs[False]
    pages = {group.spec.page_size_bytes for group in hybrid.groups}
    assert len(pages) == 1
    # Owners: sliding L0, L1, L3 (three groups of one) and global L2; L4, L5 share KV.
    assert sorted(group.spec.block_size for group in hybrid.groups) == [4, 8, 8, 8]
    (global_group,) = [g for g in hybrid.groups if g.spec.block_size == 4]
    assert global_group.layer_names[0] == attention_layer_name(2)
    assert global_group.spec.keys_from_values
    assert global_group.spec.page_size_bytes == 4 * 64 * 4  # one fp32 tensor per token
    sliding = [g.spec for g in hybrid.groups if g.spec.block_size == 8]
    assert not any(spec.keys_from_values for spec in sliding)
    (folded,) = configs[True].groups
    assert isinstance(folded.spec, UniformTypeKVCacheSpecs)
    assert folded.spec.block_size == 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gemma4_moe", "gpt_oss"])
def test_tensor_parallel_2_matches_transformers(name, request):
    """Two gloo ranks: query/KV heads, sinks, MLP and expert widths split over ranks."""
    saved = request.getfixturevalue(name)
    tokens, cached = _generate(saved, tensor_parallel_size=2, kv_sharing_fast_prefill=True)
    assert tokens == saved.greedy
    assert all(num > 0 for num in cached)


TRITON_RUN = """
import json
from cluster import LLM, SamplingParams
from kernels import triton_attention

assert triton_attention.is_interpreted()
llm = LLM({path!r}, attention_backend="triton", kv_sharing_fast_prefill=True, **{args!r})
outputs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
print(json.dumps([output.outputs[0].token_ids for output in outputs]))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", ["gemma4", "gpt_oss"])
def test_triton_kernels_serve_the_models_like_transformers(name, request):
    """The Triton kernels (interpreted on the CPU, in a fresh process) behind the engine: keys
    rebuilt from the cached values (Gemma 4's K = V layers, also read by a KV-sharing layer)
    and attention sinks (gpt-oss) give transformers' greedy tokens."""
    saved = request.getfixturevalue(name)
    code = TRITON_RUN.format(path=str(saved.path), args=LLM_ARGS, prompts=PROMPTS[:2])
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    tokens = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tokens == [greedy[:8] for greedy in saved.greedy[:2]]

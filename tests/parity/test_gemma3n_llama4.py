"""Gemma 3n and Llama 4 text against transformers (CPU fp32), and truncated prefill end to end.

Prefill logits must match transformers within 1e-4; greedy tokens through the offline `LLM`
(chunked prefill, block size 4) must equal transformers' `generate`, with truncated prefill on
and off and, for Llama 4, with the hybrid KV cache manager on and off. A Llama 4 variant whose
config adds `kv_sharing_targets` is the 8-layer example of the attention-group placement.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import transformers

from cluster import LLM, SamplingParams
from scheduler.kv_cache.builder import build_kv_cache_config
from tests.helpers.paged_driver import PagedDriver
from tests.helpers.shared_kv_reference import greedy_with_shared_kv
from tests.helpers.tiny_gemma3n import COMMON
from tests.helpers.tiny_gemma3n import GEMMA3N as TINY_GEMMA3N
from tests.helpers.tiny_models import hf_greedy, load_our_model, random_eager_model
from worker.attention.attention import Attention, ForwardContext
from worker.attention.metadata_transforms import ChunkedLocalBatches, StepRows, apply_transforms
from worker.config import ModelConfig, ParallelConfig
from worker.kv_cache import attention_layers, report_kv_cache_specs
from worker.models.decoder import attention_layer_name as _layer
from worker.models.decoder import layer_prefix
from worker.models.registry import get_model_class
from worker.weights import iterate_weights

pytestmark = pytest.mark.parity

GEMMA3N = {
    **TINY_GEMMA3N,
    "final_logit_softcapping": 5.0,
    "attention_bias": True,  # False in released checkpoints; True exercises every projection
}
LLAMA4 = {
    **COMMON,
    "intermediate_size": 32,
    "intermediate_size_mlp": 96,
    "num_hidden_layers": 4,
    "attention_chunk_size": 8,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "interleave_moe_layer_step": 2,
    "no_rope_layer_interval": 2,
    "floor_scale": 4,
    "rope_parameters": {  # Llama 4's llama3-style scaling, with a short original context
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}
# L0 full, L1 local, L2 -> L0, L3 -> L1, L4 full, L5 local, L6 -> L4, L7 -> L5. L7 is the one
# NoPE layer, so with truncated prefill its temperature tuning reads the gathered positions.
LLAMA4_SHARED = {
    **LLAMA4,
    "num_hidden_layers": 8,
    "no_rope_layer_interval": 8,
    "layer_types": ["full_attention", "chunked_attention"] * 4,
    "kv_sharing_targets": {"2": 0, "3": 1, "6": 4, "7": 5},
}
# The last prompt ends exactly at a chunk boundary of LLAMA4 (two chunks of 8) and at the step
# budget, so its first decode token starts a new chunk.
PROMPTS = [
    [(7 * i + 3) % 256 for i in range(30)],
    [(11 * i + 5) % 256 for i in range(5)],
    [(13 * i + 1) % 256 for i in range(16)],
]
NUM_NEW = 32
LLM_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_batched_tokens": 16,
    "kv_cache_memory_bytes": 1 << 22,
}


def _save(config_cls: str, model_cls: str, kwargs: dict, path: Path) -> torch.nn.Module:
    config = getattr(transformers, config_cls)(**kwargs)
    model = random_eager_model(config, model_cls, lambda name: "norm" in name)
    model.save_pretrained(path)
    return model


class Saved(NamedTuple):
    """A saved tiny model, its transformers twin and that twin's greedy tokens for PROMPTS."""

    path: Path
    hf_model: torch.nn.Module
    greedy: list[list[int]]


def _saved(config_cls: str, model_cls: str, kwargs: dict, path: Path) -> Saved:
    hf_model = _save(config_cls, model_cls, kwargs, path)
    return Saved(path, hf_model, [hf_greedy(hf_model, prompt, NUM_NEW) for prompt in PROMPTS])


@pytest.fixture(scope="module")
def gemma3n(tmp_path_factory) -> Saved:
    path = tmp_path_factory.mktemp("gemma3n")
    return _saved("Gemma3nTextConfig", "Gemma3nForCausalLM", GEMMA3N, path)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Saved:
    path = tmp_path_factory.mktemp("llama4")
    return _saved("Llama4TextConfig", "Llama4ForCausalLM", LLAMA4, path)


@pytest.fixture(scope="module")
def llama4_shared(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama4_shared")
    return path, _save("Llama4TextConfig", "Llama4ForCausalLM", LLAMA4_SHARED, path)


def _shared_kv_greedy(hf_model: torch.nn.Module) -> list[list[int]]:
    """transformers with the sharing of LLAMA4_SHARED done by hand (the independent reference)."""
    targets = {int(layer): target for layer, target in LLAMA4_SHARED["kv_sharing_targets"].items()}
    return [greedy_with_shared_kv(hf_model, prompt, NUM_NEW, targets) for prompt in PROMPTS]


class _LocalDriver(PagedDriver):
    """The paged driver with chunked-local layers cut into virtual batches."""

    @torch.inference_mode()
    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        meta, ids, positions = self._metadata({"r": token_ids})
        step = StepRows(logits_indices=torch.tensor([len(ids) - 1]))
        metadata = {}
        for layer in self.model.modules():
            if isinstance(layer, Attention):
                chunk = layer.config.attention_chunk_size
                transforms = (ChunkedLocalBatches(chunk, self.block_size),) if chunk else ()
                metadata[layer.layer_name] = apply_transforms(meta, transforms, step)
        ctx = ForwardContext(metadata=metadata, kv_caches=self.kv_caches)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), ctx)
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("name", ["gemma3n", "llama4"])
def test_prefill_logits_match_transformers(name, request):
    path, hf_model, _ = request.getfixturevalue(name)
    prompt = PROMPTS[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    got = _LocalDriver(load_our_model(path), block_size=4).prefill(prompt)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _generate(path, params, **kwargs):
    llm = LLM(str(path), **LLM_ARGS, **kwargs)
    try:
        results = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return results


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)


@pytest.mark.parametrize(
    ("fast_prefill", "disable_hybrid"), [(False, False), (True, False), (True, True)]
)
def test_gemma3n_greedy_tokens_match_transformers(gemma3n, fast_prefill, disable_hybrid):
    results = _generate(
        gemma3n.path,
        GREEDY,
        kv_sharing_fast_prefill=fast_prefill,
        disable_hybrid_kv_cache_manager=disable_hybrid,
    )
    assert [r.outputs[0].token_ids for r in results] == gemma3n.greedy


@pytest.mark.parametrize("disable_hybrid", [False, True])
def test_llama4_greedy_tokens_match_transformers(llama4, disable_hybrid):
    results = _generate(llama4.path, GREEDY, disable_hybrid_kv_cache_manager=disable_hybrid)
    assert [r.outputs[0].token_ids for r in results] == llama4.greedy


def test_llama4_kv_sharing_same_tokens_with_truncated_prefill_and_hybrid_on_and_off(
    llama4_shared,
):
    """Every setting gives the tokens of transformers with the K/V sharing done by hand."""
    path, hf_model = llama4_shared
    tokens, groups = {}, {}
    for fast in (False, True):
        for hybrid_off in (False, True):
            llm = LLM(
                str(path),
                **LLM_ARGS,
                kv_sharing_fast_prefill=fast,
                disable_hybrid_kv_cache_manager=hybrid_off,
            )
            results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            runner = llm.client.core.executor.worker.model_runner
            groups[fast, hybrid_off] = {
                (g.kv_cache_group_id, frozenset(g.layer_names)) for g in runner.attention_groups
            }
            tokens[fast, hybrid_off] = [r.outputs[0].token_ids for r in results]
            llm.shutdown()
    expected = _shared_kv_greedy(hf_model)
    assert all(t == expected for t in tokens.values())
    full = frozenset({_layer(0), _layer(4), _layer(2)})
    local = frozenset({_layer(1), _layer(5), _layer(3)})
    assert groups[True, True] == {
        (0, full),
        (0, local),
        (0, frozenset({_layer(6)})),
        (0, frozenset({_layer(7)})),
    }
    hybrid = {gid for gid, names in groups[True, False]}
    assert len(hybrid) == 2
    assert {names for _, names in groups[True, False]} == {
        full,
        local,
        frozenset({_layer(6)}),
        frozenset({_layer(7)}),
    }


def test_truncated_prefill_runs_shared_layers_on_fewer_rows(gemma3n):
    """Observed with hooks: in prefill steps the last layer sees only the sampled rows (or does
    not run when no request finishes its prompt); decode steps keep every row.

    With a 16-token budget the third step mixes all three cases: request 0 decodes, request 1
    finishes its prompt (3 tokens) and request 2 prefills 12 of its 16 prompt tokens."""
    llm = LLM(str(gemma3n.path), **LLM_ARGS, kv_sharing_fast_prefill=True)
    model = llm.client.core.executor.worker.model_runner.model.model
    steps: list[dict[str, int]] = []

    def record(key: str):
        return lambda _module, args: steps[-1].__setitem__(key, len(args[0]))

    hooks = [
        model.register_forward_pre_hook(lambda _module, _args: steps.append({})),
        model.layers[0].register_forward_pre_hook(record("first")),
        model.layers[-1].register_forward_pre_hook(record("last")),
    ]
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for hook in hooks:
        hook.remove()
    llm.shutdown()
    assert steps[0] == {"first": 16}  # 16 prompt tokens, no prompt finished: layer 5 skipped
    assert steps[2] == {"first": 16, "last": 2}  # the mixed step: two rows reach the LM head
    assert any(step.get("last", 0) < step["first"] for step in steps)
    assert all(step.get("last", 0) <= step["first"] for step in steps)
    assert {"first": 3, "last": 3} in steps  # a decode step of all three requests


def test_prompt_logprobs_equal_with_truncated_prefill_on_and_off(gemma3n):
    path, hf_model, _ = gemma3n
    params = [
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=2),
        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
    ]
    on = _generate(path, params, kv_sharing_fast_prefill=True)
    off = _generate(path, params, kv_sharing_fast_prefill=False)
    for idx in (0, 2):
        prompt = PROMPTS[idx]
        with torch.no_grad():
            logprobs = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], -1)
        expected = [logprobs[pos, prompt[pos + 1]].item() for pos in range(len(prompt) - 1)]
        for results in (on, off):
            entries = results[idx].prompt_logprobs
            assert entries[0] is None
            assert [next(iter(e)) for e in entries[1:]] == prompt[1:]
            chosen = [e[t].logprob for e, t in zip(entries[1:], prompt[1:], strict=True)]
            assert chosen == pytest.approx(expected, abs=1e-4)
        pairs = zip(on[idx].prompt_logprobs[1:], off[idx].prompt_logprobs[1:], strict=True)
        assert all(
            a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5)
            for (a, b), t in zip(pairs, prompt[1:], strict=True)
        )
    assert [r.outputs[0].token_ids for r in on] == [r.outputs[0].token_ids for r in off]


def test_gemma3n_kv_capacity_counts_only_owning_layers(gemma3n):
    """S25 on Gemma 3n: 3 of 6 layers share, so one block costs 3 pages, not 6."""
    report = report_kv_cache_specs(attention_layers(load_our_model(gemma3n.path)), 16, 4)
    # The last layer of each type before the shared run: full L1, sliding L2.
    assert report.shared_kv_layers == {
        _layer(3): _layer(1),
        _layer(4): _layer(2),
        _layer(5): _layer(1),
    }
    page = next(iter(report.layer_specs.values())).page_size_bytes
    memory = 3 * 6 * page * 100
    owners = {
        name: spec
        for name, spec in report.layer_specs.items()
        if name not in report.shared_kv_layers
    }
    shared = build_kv_cache_config(
        report.layer_specs, memory, shared_kv_layers=report.shared_kv_layers, disable_hybrid=True
    )
    unshared = build_kv_cache_config(
        {**owners, **{name: owners[target] for name, target in report.shared_kv_layers.items()}},
        memory,
        disable_hybrid=True,
    )
    assert shared.num_blocks == memory // (3 * page) == 600
    assert unshared.num_blocks == memory // (6 * page) == 300
    assert math.isclose(shared.num_blocks / unshared.num_blocks, 2.0)


def test_gemma3n_loads_released_checkpoints_with_kv_tensors_on_shared_layers(gemma3n, caplog):
    """Released checkpoints still hold k/v projections and norms for the shared layers; they
    are skipped on purpose (no "matches no parameter" warning) and leave nothing unloaded."""
    model = get_model_class("Gemma3nForCausalLM")(
        ModelConfig.from_pretrained(gemma3n.path), ParallelConfig()
    )
    extra = [
        (f"{layer_prefix(idx)}self_attn.{name}.weight", torch.zeros(1))
        for idx in (3, 4, 5)
        for name in ("k_proj", "v_proj", "k_norm")
    ]
    with caplog.at_level("WARNING"):
        loaded = model.load_weights([*iterate_weights(gemma3n.path), *extra])
    assert loaded == {name for name, _ in model.named_parameters()}
    assert "matches no parameter" not in caplog.text


def test_llama_family_kv_sharing_option_same_tokens_with_truncated_prefill(tmp_path):
    """The shared decoder (here Qwen2, L0 full, L1 sliding, ...) reads `kv_sharing_targets`:
    the tokens of transformers with the K/V sharing done by hand, in every setting."""
    config = {
        **COMMON,
        "intermediate_size": 96,
        "num_hidden_layers": 8,
        "use_sliding_window": True,
        "sliding_window": 6,
        "layer_types": ["full_attention", "sliding_attention"] * 4,
        "kv_sharing_targets": LLAMA4_SHARED["kv_sharing_targets"],
    }
    hf_model = _save("Qwen2Config", "Qwen2ForCausalLM", config, tmp_path)
    report = report_kv_cache_specs(attention_layers(load_our_model(tmp_path)), 16, 4)
    assert report.shared_kv_layers == {
        _layer(i): _layer(t) for i, t in [(2, 0), (3, 1), (6, 4), (7, 5)]
    }
    runs = [
        _generate(
            tmp_path,
            GREEDY,
            kv_sharing_fast_prefill=fast,
            disable_hybrid_kv_cache_manager=hybrid_off,
        )
        for fast, hybrid_off in [(False, False), (True, False), (True, True)]
    ]
    tokens = [[r.outputs[0].token_ids for r in results] for results in runs]
    targets = {2: 0, 3: 1, 6: 4, 7: 5}
    expected = [greedy_with_shared_kv(hf_model, prompt, NUM_NEW, targets) for prompt in PROMPTS]
    assert tokens[0] == tokens[1] == tokens[2] == expected


@pytest.mark.parametrize("disable_hybrid", [False, True])
def test_chunk_size_not_a_multiple_of_the_block_size_fails_at_startup(tmp_path, disable_hybrid):
    _save("Llama4TextConfig", "Llama4ForCausalLM", {**LLAMA4, "attention_chunk_size": 6}, tmp_path)
    with pytest.raises(ValueError, match=r"chunk (size )?6 .*not a multiple of .*block size 4"):
        LLM(str(tmp_path), **LLM_ARGS, disable_hybrid_kv_cache_manager=disable_hybrid)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["gemma3n", "llama4"])
def test_tensor_parallel_2_with_truncated_prefill_matches_transformers(name, request):
    """Two gloo ranks: KV heads, MLP/expert widths and per-layer tables split over ranks."""
    saved = request.getfixturevalue(name)
    results = _generate(saved.path, GREEDY, tensor_parallel_size=2, kv_sharing_fast_prefill=True)
    assert [r.outputs[0].token_ids for r in results] == saved.greedy

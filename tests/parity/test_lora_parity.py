"""LoRA adapters end to end against transformers + PEFT (adapter merged), CPU fp32.

Each family gets two random adapters on every projection PEFT targets in it (attention q/k/v/o,
MLP gate/up/down, Mamba-2 in_proj/out_proj, gated-DeltaNet in_proj_qkvz/in_proj_ba or Qwen3.5's
four projections and out_proj, LFM2's conv in_proj/out_proj and w1/w2/w3), and on the routed MoE
experts through PEFT's `target_parameters` (gpt-oss: transposed [E, in, out] stacks; Granite-4.0-H:
[E, out, in]; Llama 4: [E, in, out] that PEFT reads as [E, out, in]; Qwen3-Next: one module per
expert in our model); one batch mixes the
base model and both adapters, with chunked prefill through block size 4, and every request's
greedy tokens must equal the merged model's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from cluster import LLM, LoRARequest, SamplingParams
from tests.helpers.tiny_gemma4_gpt_oss import GPT_OSS, save_gemma4_or_gpt_oss
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_lora import save_random_adapter
from tests.helpers.tiny_models import hf_greedy, save_tiny_model

pytestmark = pytest.mark.parity

NUM_NEW = 8
PROMPTS = [[(7 * i + 3) % 256 for i in range(21)], [(11 * i + 5) % 256 for i in range(9)]]
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_NEW)
LLM_ARGS = {"block_size": 4, "max_num_batched_tokens": 16, "kv_cache_memory_bytes": 1 << 22}

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


class Targets(NamedTuple):
    save: Callable[[str, Path], torch.nn.Module]
    modules: list[str] | None = None
    """PEFT's target_modules (None: every linear layer)."""
    parameters: list[str] | None = None
    """PEFT's target_parameters (stacked MoE expert weights)."""
    spread: float = 0.3
    """Spread of the random adapter entries (smaller where large expert deltas make near-ties)."""


def _save_gpt_oss(_: str, path: Path) -> torch.nn.Module:
    return save_gemma4_or_gpt_oss("GptOssConfig", "GptOssForCausalLM", GPT_OSS, path)


# Qwen3-Next's MLP names make PEFT convert them to its stacked experts with a rank_pattern (not
# served): its experts are targeted as parameters, the dense-MLP projections are covered by Qwen3.5.
FAMILIES: dict[str, Targets] = {
    "llama": Targets(save_tiny_model),
    "gemma3": Targets(save_tiny_model),
    "bamba": Targets(save_tiny_hybrid),
    "granitemoehybrid": Targets(save_tiny_hybrid, parameters=EXPERTS),
    "qwen3_next": Targets(
        save_tiny_linear_hybrid,
        [*ATTENTION, "in_proj_qkvz", "in_proj_ba", "out_proj"],
        EXPERTS,
    ),
    "qwen3_5": Targets(save_tiny_linear_hybrid),
    "lfm2": Targets(save_tiny_linear_hybrid),
    "gpt_oss": Targets(_save_gpt_oss, parameters=EXPERTS, spread=0.1),
    "llama4": Targets(save_tiny_model, parameters=EXPERTS),
}


class Family(NamedTuple):
    name: str
    path: Path
    adapters: list[LoRARequest]
    expected: dict[tuple[str | None, int], list[int]]
    """(adapter name or None, prompt index) -> transformers' greedy tokens."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    targets = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_model = targets.save(request.param, root / "base")
    models: dict[str | None, torch.nn.Module] = {None: hf_model}
    adapters = []
    for seed, name in enumerate(("one", "two"), start=1):
        models[name] = save_random_adapter(
            hf_model,
            root / name,
            targets.modules,
            seed=seed,
            target_parameters=targets.parameters,
            spread=targets.spread,
        )
        adapters.append(LoRARequest(name, seed, str(root / name)))
    expected = {
        (name, index): hf_greedy(model, prompt, NUM_NEW)
        for name, model in models.items()
        for index, prompt in enumerate(PROMPTS)
    }
    return Family(request.param, root / "base", adapters, expected)


def test_mixed_adapter_batch_matches_merged_peft_models(family: Family) -> None:
    """Base, adapter one and adapter two in one batch: each equals its merged model."""
    one, two = family.adapters
    for index in range(len(PROMPTS)):  # a no-op or misapplied adapter would pass unnoticed
        assert family.expected[("one", index)] != family.expected[(None, index)]
        assert family.expected[("two", index)] != family.expected[("one", index)]
    llm = LLM(model=str(family.path), enable_lora=True, max_loras=2, **LLM_ARGS)
    loras = [None, one, two, one, two, None]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[1]]
    results = llm.generate(prompts, GREEDY, lora_request=loras)
    for lora, prompt, result in zip(loras, prompts, results, strict=True):
        name = None if lora is None else lora.lora_name
        expected = family.expected[(name, PROMPTS.index(prompt))]
        assert result.outputs[0].token_ids == expected, (name, PROMPTS.index(prompt))
    llm.shutdown()


TENSOR_PARALLEL_FAMILIES = (
    "llama",
    "bamba",
    "qwen3_5",
    "granitemoehybrid",
    "gpt_oss",
    "qwen3_next",
)
"""Split attention, Mamba-2 in_proj rows, gated-DeltaNet q/k/v/z/b/a rows, row-parallel
output projections (the adapter's shrink all-reduced) and experts' intermediate features."""


@pytest.mark.slow
def test_tensor_parallel_2_cuts_adapters_like_weights(family: Family) -> None:
    if family.name not in TENSOR_PARALLEL_FAMILIES:
        pytest.skip("tensor parallelism is covered by the families of TENSOR_PARALLEL_FAMILIES")
    one, two = family.adapters
    llm = LLM(
        model=str(family.path), enable_lora=True, max_loras=2, tensor_parallel_size=2, **LLM_ARGS
    )
    try:
        results = llm.generate([PROMPTS[0]] * 3, GREEDY, lora_request=[one, None, two])
    finally:
        llm.shutdown()
    for name, result in zip(("one", None, "two"), results, strict=True):
        assert result.outputs[0].token_ids == family.expected[(name, 0)], name


@pytest.fixture(scope="module")
def bamba_adapters(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """Bamba (attention + Mamba-2) with two adapters, for prefix-cache identity."""
    root = tmp_path_factory.mktemp("bamba_prefix")
    hf_model = save_tiny_hybrid("bamba", root / "base")
    models: dict[str | None, torch.nn.Module] = {None: hf_model}
    adapters = []
    for seed, name in enumerate(("one", "two"), start=1):
        models[name] = save_random_adapter(hf_model, root / name, seed=seed)
        adapters.append(LoRARequest(name, seed, str(root / name)))
    prompt = PROMPTS[0]
    expected = {(name, 0): hf_greedy(model, prompt, NUM_NEW) for name, model in models.items()}
    return Family("bamba", root / "base", adapters, expected)


@pytest.mark.parametrize("prefix_match_unit", [None, 4])
def test_prefix_hits_never_cross_adapters_and_survive_reloads(
    bamba_adapters: Family, prefix_match_unit: int | None
) -> None:
    """Attention blocks and Mamba states (block ends, or 4-token checkpoints) are cached per
    adapter: another adapter or the base model never hits them, the same adapter always does,
    also after it left the device and host slots (one slot each) and was read again."""
    one, two = bamba_adapters.adapters
    llm = LLM(
        model=str(bamba_adapters.path),
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=1,
        prefix_match_unit=prefix_match_unit,
        **LLM_ARGS,
    )
    runs = [one, two, None, one, two, None]
    cached = []
    for lora in runs:
        (result,) = llm.generate([PROMPTS[0]], GREEDY, lora_request=lora)
        name = None if lora is None else lora.lora_name
        assert result.outputs[0].token_ids == bamba_adapters.expected[(name, 0)], name
        cached.append(result.num_cached_tokens)
    assert cached[:3] == [0, 0, 0]  # three identities, three cold prefills
    assert min(cached[3:]) > 0  # each one hits its own blocks (adapters reloaded from disk)
    llm.shutdown()


@pytest.mark.parametrize("lora_prefetch", [True, False])
def test_adapters_named_again_are_copied_before_their_step(
    bamba_adapters: Family, lora_prefetch: bool
) -> None:
    """One device slot, two adapters alternating with base-model requests (one request at a
    time): while a base request runs, the adapter of the next waiting request replaces the
    other one in the slot, so no step copies an adapter itself; outputs stay the merged models'."""
    one, two = bamba_adapters.adapters
    llm = LLM(
        model=str(bamba_adapters.path),
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_num_seqs=1,
        lora_prefetch=lora_prefetch,
        **LLM_ARGS,
    )
    loras = [one, None, two, None, one, None, two]
    try:
        results = llm.generate([PROMPTS[0]] * len(loras), GREEDY, lora_request=loras)
        manager = llm.client.core.executor.worker.model_runner.lora
    finally:
        llm.shutdown()
    for lora, result in zip(loras, results, strict=True):
        name = None if lora is None else lora.lora_name
        assert result.outputs[0].token_ids == bamba_adapters.expected[(name, 0)], name
    # the first step copies "one" (its projections get their slots there); each later switch is
    # a copy ahead of its step, or one inside it
    expected_copies = (1, 3) if lora_prefetch else (4, 0)
    assert (manager.num_step_loads, manager.num_copies_ahead) == expected_copies

"""Draft models with recurrent-state layers (Mamba-2, gated DeltaNet, short conv) keep greedy
tokens identical to decoding without speculation (CPU fp32, tiny random models, offline `LLM`).

The drafter is the target itself (every draft accepted) or a perturbed copy of it (part of the
drafts rejected, so the drafter resumes from the state of the last accepted token); every
proposal is the drafter's own greedy continuation (transformers) of the tokens so far. Prefix
caching is on: each prompt set runs twice, the second time hitting the cache, and the first
prompt is prefilled in chunks (also: async scheduling, preemption). The hits are as long as
without speculation, the drafter's state groups are its own, and every block is back in the pool
afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.helpers.drafters import save_perturbed_copy
from tests.helpers.engine_probe import (
    engine_stats,
    kv_cache_groups,
    record_drafts,
    watch_preemptions,
)
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import hf_greedy

pytestmark = pytest.mark.parity

PROMPTS = [[(7 * i + 3) % 256 for i in range(29)], [1, 2, 3, 4, 5, 6] * 4]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
LLM_ARGS: dict[str, Any] = {
    "block_size": 4,
    "max_num_batched_tokens": 16,  # the first prompt is prefilled in two chunks
    "kv_cache_memory_bytes": 1 << 22,
    # synchronous steps draft at every step, so each perturbed case meets a rejection; async
    # steps are SCHEDULING_CASES["async"]
    "async_scheduling": False,
}
Saver = Callable[..., torch.nn.Module]
FAMILIES: dict[str, tuple[Saver, float]] = {
    "bamba": (save_tiny_hybrid, 0.1),  # Mamba-2
    "qwen3_5": (save_tiny_linear_hybrid, 0.03),  # gated DeltaNet
    "lfm2": (save_tiny_linear_hybrid, 0.05),  # short conv
}
"""Family -> (saver, noise scale of its perturbed copy)."""


Proposals = list[tuple[list[int], list[int]]]


def _run(path: Path, **overrides: Any) -> tuple[list[list[list[int]]], Any, Proposals]:
    """Greedy tokens of the prompts run twice (the second run hits the prefix cache), the
    scheduler's stats after both, and the drafter's proposals (tokens so far, drafts)."""
    llm = LLM(str(path), **{**LLM_ARGS, **overrides})
    rounds = []
    with record_drafts(llm) if "speculative_config" in overrides else nullcontext([]) as seen:
        for _ in range(2):
            results = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            rounds.append([result.outputs[0].token_ids for result in results])
    stats = engine_stats(llm)
    if "speculative_config" in overrides:
        groups = kv_cache_groups(llm)
        for is_drafter, layers in groups:
            assert all(name.startswith("drafter.") == is_drafter for name in layers), layers
        target = {name for is_drafter, layers in groups if not is_drafter for name in layers}
        drafter = {name for is_drafter, layers in groups if is_drafter for name in layers}
        assert drafter == {"drafter." + name for name in target}  # state layers included
        assert stats.kv_cache_usage == 0, "blocks still held after every request finished"
        llm.client.core.scheduler.kv_cache_manager.check_invariants()
    llm.shutdown()
    return rounds, stats, seen


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(target, perturbed copy, greedy tokens and hit tokens without speculation)."""
    name = request.param
    saver, scale = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    model = saver(name, root / "target")
    perturbed = save_perturbed_copy(model, root / "perturbed", scale)
    tokens, stats, _ = _run(root / "target")
    drafters = {"self": (root / "target", model), "perturbed": (root / "perturbed", perturbed)}
    return root / "target", drafters, tokens, stats.prefix_cache_hit_tokens


@pytest.mark.parametrize(
    ("drafter", "k"), [("self", 1), ("self", 3), ("perturbed", 1), ("perturbed", 3)]
)
def test_recurrent_draft_model_keeps_greedy_tokens(family: Any, drafter: str, k: int) -> None:
    target, drafters, reference, hit_tokens = family
    draft, draft_model = drafters[drafter]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    tokens, stats, proposals = _run(target, speculative_config=spec)
    assert tokens == reference
    for known, drafts in proposals:  # the drafter's state was that of the accepted tokens
        assert drafts == hf_greedy(draft_model, known, k), known
    assert stats.prefix_cache_hit_tokens == hit_tokens > 0
    spec_stats = stats.spec_decoding
    assert spec_stats is not None
    assert spec_stats.num_draft_tokens > 0
    if drafter == "self":
        assert spec_stats.num_accepted_tokens == spec_stats.num_draft_tokens
    else:
        assert 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens


SCHEDULING_CASES: dict[str, dict[str, Any]] = {
    "async": {"async_scheduling": True},
    "preemption": {"kv_cache_memory_bytes": 24 * 3072, "max_model_len": 48},
}


@pytest.mark.parametrize("family", ["bamba"], indirect=True)
@pytest.mark.parametrize("case", list(SCHEDULING_CASES))
def test_recurrent_draft_model_under_async_steps_and_preemption(family: Any, case: str) -> None:
    """A perturbed Bamba drafter with async scheduling, and in a pool small enough to preempt
    (the drafter's states are recomputed with the request's)."""
    target, drafters, reference, _ = family
    draft, draft_model = drafters["perturbed"]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, **{**LLM_ARGS, **SCHEDULING_CASES[case]})
    with watch_preemptions(llm) as preemptions, record_drafts(llm) as proposals:
        tokens = [
            [
                result.outputs[0].token_ids
                for result in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            ]
            for _ in range(2)
        ]
    llm.shutdown()
    assert tokens == reference
    assert (len(preemptions) > 0) == (case == "preemption")
    for known, drafts in proposals:
        assert drafts == hf_greedy(draft_model, known, len(drafts)), known

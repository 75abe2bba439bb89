"""Sleep and wake of the offline engine on the hybrid layouts (Qwen3.5 gated DeltaNet with its MTP
layer, Nemotron-H Mamba-2, gpt-oss sliding window with sinks and MoE, Gemma 3 sliding window),
each with prefix caching, the offload tier and speculation on: outputs after every wake equal,
bit for bit, those before the first sleep; the memory given back; requests kept through a sleep
recomputed; bad calls refused in one line."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cluster import LLM
from tests.helpers.sleep_cycles import (
    ENGINE_ARGS,
    PARAMS,
    PROMPTS,
    generate,
    rss_bytes,
    run_cycles,
    save_layout,
)

pytestmark = pytest.mark.parity

FAMILIES = ["qwen3_5", "nemotron_h", "gpt_oss", "gemma3"]
NUM_CYCLES = 4
"""Per layout in the default suite (each level twice); the slow test runs 25 (100 in all)."""
NUM_CYCLES_SLOW = 25


@pytest.fixture(scope="module", params=FAMILIES)
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LLM]:
    path = tmp_path_factory.mktemp(request.param)
    spec = save_layout(request.param, path)
    llm = LLM(str(path), speculative_config=spec, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


def _worker(llm: LLM) -> Any:
    return llm.client.core.executor.worker  # type: ignore[attr-defined]


def _drafting(llm: LLM) -> tuple[int, int]:
    """(draft tokens, accepted) of one generation of the prompts."""
    before = llm.client.get_stats().spec_decoding
    generate(llm)
    after = llm.client.get_stats().spec_decoding
    assert before is not None
    assert after is not None
    drafted = after.num_draft_tokens - before.num_draft_tokens
    return drafted, after.num_accepted_tokens - before.num_accepted_tokens


def test_sleep_wake_cycles_keep_every_output(engine: LLM) -> None:
    """Levels 1 and 2 in turn, weights woken first then the KV cache, prompts cached before:
    every generation equals the first (tokens and logprobs), and the drafter drafts and is
    accepted as before the first sleep."""
    drafting = _drafting(engine)
    assert run_cycles(engine, NUM_CYCLES) == NUM_CYCLES
    assert drafting[0] > 0
    assert _drafting(engine) == drafting


@pytest.mark.slow
def test_one_hundred_sleep_wake_cycles(engine: LLM) -> None:
    assert run_cycles(engine, NUM_CYCLES_SLOW) == NUM_CYCLES_SLOW


def test_sleep_gives_back_weights_and_pool(engine: LLM) -> None:
    """Process RSS falls by at least 95 % of the weights (model and drafter) and the KV pool at
    both levels, and the memory comes back at wake."""
    worker = _worker(engine)
    modules = [worker.model_runner.model, worker._drafter]
    params = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for m in modules
        if m is not None
        for p in m.parameters()
    }
    pool = sum(t.size_bytes for t in engine.client.core.scheduler.kv_cache_config.tensors)  # type: ignore[attr-defined]
    expected = sum(params.values()) + pool
    for level in (1, 2):
        before = rss_bytes()
        engine.sleep(level=level)
        released = before - rss_bytes()
        engine.wake_up()
        assert released >= 0.95 * expected, (level, released, expected)
    assert generate(engine)  # awake again


def test_kept_requests_resume_with_their_kv_recomputed(engine: LLM) -> None:
    """Two requests mid-generation kept through a level-1 sleep (their KV freed) finish with the
    tokens of an undisturbed run; the scheduler preempted them to recompute."""
    expected = generate(engine)
    streams = [engine.stream(prompt, PARAMS) for prompt in PROMPTS]
    heads = [[*next(stream).outputs[0].token_ids] for stream in streams]
    preemptions = engine.client.get_stats().num_preemptions
    engine.sleep(level=1, mode="keep")
    with pytest.raises(RuntimeError, match="paused or asleep"):
        engine.generate(PROMPTS, PARAMS)
    engine.wake_up()
    assert engine.client.get_stats().num_preemptions >= preemptions + len(PROMPTS)
    for head, stream, (tokens, _) in zip(heads, streams, expected, strict=True):
        rest = [t for delta in stream for t in delta.outputs[0].token_ids]
        assert head + rest == tokens

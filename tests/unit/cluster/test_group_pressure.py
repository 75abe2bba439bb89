"""Per KV cache group used / free / reclaimable blocks and the group that limited admission, on
tiny engines with a few dozen blocks: a sliding-window model, a Mamba-2 hybrid and a gated
DeltaNet hybrid, each driven until the group its workload strains refuses the queue's head.

After every scheduled step the snapshot is checked against the pool and the block tables
themselves; the results also reach `LLM.get_metrics()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.metric_reader import ADMISSION_LIMITED, GROUP_BLOCKS, GROUP_PRESSURE
from scheduler.kv_cache.pressure import MAX_NUM_SEQS, TOKEN_BUDGET, GroupPressure
from scheduler.scheduler import Scheduler
from tests.helpers.engine_probe import engine_stats
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_layouts import save_family
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid

MAX_MODEL_LEN = 64
PREFIX = [(7 * i + 3) % 200 + 1 for i in range(48)]


def _shared_prefix(num_prompts: int) -> list[list[int]]:
    """A shared 48-token system prompt, then three tokens of each request's own."""
    return [[*PREFIX, 201 + i, 202 + i, 203 + i] for i in range(num_prompts)]


def _distinct(num_prompts: int) -> list[list[int]]:
    """Long prompts with nothing in common."""
    return [[(13 * i + 5 * j) % 200 + 1 for j in range(60)] for i in range(num_prompts)]


class Case(NamedTuple):
    save: Callable[[Path], object]
    num_blocks: int
    prompts: list[list[int]]
    max_tokens: int
    limiting_kind: str
    """The kind of the group expected to refuse admissions most often."""


CASES = {
    # Every layer in one sliding-window group: its window blocks are all there is.
    "mistral": Case(lambda p: save_family("mistral", p), 40, _distinct(16), 8, "sliding_window"),
    # A cached system prompt: attention reuses the blocks running requests hold, while each new
    # request revives the prompt's last state and takes a fresh one in every Mamba group.
    "bamba": Case(lambda p: save_tiny_hybrid("bamba", p), 40, _shared_prefix(48), 8, "mamba"),
    # Long distinct prompts: a DeltaNet group needs one state block, attention a block per
    # eight tokens.
    "qwen3_5": Case(
        lambda p: save_tiny_linear_hybrid("qwen3_5", p), 60, _distinct(16), 4, "full_attention"
    ),
}


def _engine(path: Path, num_blocks: int, **kwargs: int) -> LLM:
    """An engine whose pool holds `num_blocks` blocks (null block included)."""
    args = {"dtype": "float32", "block_size": 4, "max_model_len": MAX_MODEL_LEN}
    probe = LLM(str(path), kv_cache_memory_bytes=1 << 20, **args)  # type: ignore[arg-type]
    block_bytes = (1 << 20) // probe.client.core.scheduler.kv_cache_config.num_blocks
    probe.shutdown()
    memory = num_blocks * block_bytes
    return LLM(str(path), kv_cache_memory_bytes=memory, **args, **kwargs)  # type: ignore[arg-type]


def _check_against_pool(scheduler: Scheduler) -> tuple[GroupPressure, ...]:
    """The snapshot's per-group numbers, recounted from the block tables (and the state
    checkpoints a step in flight writes, held outside them) and the prefix cache."""
    groups = scheduler.make_stats().group_pressure
    manager = scheduler.kv_cache_manager
    pool = manager.pool
    config_kinds = [group.spec.kind for group in scheduler.kv_cache_config.groups]
    assert [group.kind for group in groups] == config_kinds
    free = groups[0].free
    assert all(group.free == free for group in groups)
    assert sum(g.used for g in groups) + free + sum(g.reclaimable for g in groups) == (
        pool.num_blocks - 1
    )
    outside = manager.checkpoints.held_blocks() if manager.checkpoints is not None else []
    for group_id, (group, tables) in enumerate(
        zip(groups, manager.coordinator.managers, strict=True)
    ):
        held = {b.block_id for t in tables.req_to_blocks.values() for b in t if b.block_id}
        held |= {block.block_id for block in outside if block.group_id == group_id}
        assert group.used == len(held)
        duplicates = pool._duplicates[group_id].values()
        cached = [*pool.hash_maps[group_id].values(), *(b for d in duplicates for b in d.values())]
        assert group.reclaimable == sum(block.ref_cnt == 0 for block in cached)
    return groups


@contextmanager
def checked_steps(llm: LLM) -> Iterator[list[tuple[GroupPressure, ...]]]:
    """Check every step's snapshot against the pool (`_check_against_pool`); yield them."""
    scheduler = llm.client.core.scheduler
    schedule = scheduler.schedule
    seen: list[tuple[GroupPressure, ...]] = []

    def checked_schedule():  # type: ignore[no-untyped-def]
        output = schedule()
        seen.append(_check_against_pool(scheduler))
        return output

    scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del scheduler.schedule


@pytest.mark.parametrize("family", list(CASES))
def test_group_blocks_add_up_and_the_strained_group_limits_admission(
    family: str, tmp_path: Path
) -> None:
    case = CASES[family]
    case.save(tmp_path)
    llm = _engine(tmp_path, case.num_blocks)
    params = SamplingParams(temperature=0, max_tokens=case.max_tokens)
    llm.generate([{"prompt_token_ids": [*PREFIX, 250]}], SamplingParams(max_tokens=1))
    with checked_steps(llm) as snapshots:
        llm.generate([{"prompt_token_ids": prompt} for prompt in case.prompts], params)
    assert any(group.used for groups in snapshots for group in groups)
    assert any(group.reclaimable for groups in snapshots for group in groups)
    stats = engine_stats(llm)
    by_group = {label: steps for label, steps in stats.admission_limited if ":" in label}
    groups = llm.client.core.scheduler.kv_cache_config.groups
    first_of_kind = next(
        i for i, group in enumerate(groups) if group.spec.kind == case.limiting_kind
    )
    assert max(by_group, key=by_group.__getitem__) == f"{first_of_kind}:{case.limiting_kind}"
    _check_metrics(llm, stats.group_pressure, stats.admission_limited)


def _check_metrics(
    llm: LLM, groups: tuple[GroupPressure, ...], limited: tuple[tuple[str, int], ...]
) -> None:
    """`LLM.get_metrics()` has every group's blocks by state, its pressure and the counter."""
    metrics = llm.get_metrics()
    blocks = {
        (m.labels["group"], m.labels["state"]): m.value  # type: ignore[attr-defined]
        for m in metrics
        if m.name == GROUP_BLOCKS
    }
    pressure = {m.labels["group"]: m.value for m in metrics if m.name == GROUP_PRESSURE}  # type: ignore[attr-defined]
    for group in groups:
        gid = str(group.group_id)
        assert blocks[gid, "used"] == group.used
        assert blocks[gid, "free"] == group.free
        assert blocks[gid, "reclaimable"] == group.reclaimable
        assert pressure[gid] == group.pressure
    counted = {
        (m.labels["group"], m.labels["kind"]): m.value  # type: ignore[attr-defined]
        for m in metrics
        if m.name == ADMISSION_LIMITED
    }
    assert counted == {tuple(label.split(":")): steps for label, steps in limited}


@pytest.mark.parametrize(
    ("limit", "engine_args"),
    [(MAX_NUM_SEQS, {"max_num_seqs": 1}), (TOKEN_BUDGET, {"max_num_batched_tokens": 16})],
)
def test_seats_and_token_budget_are_counted_under_their_own_names(
    limit: str, engine_args: dict[str, int], tmp_path: Path
) -> None:
    save_family("mistral", tmp_path)
    llm = _engine(tmp_path, 200, **engine_args)
    llm.generate(
        [{"prompt_token_ids": prompt[:40]} for prompt in _distinct(3)],
        SamplingParams(temperature=0, max_tokens=4),
    )
    assert {label for label, _ in engine_stats(llm).admission_limited} == {limit}

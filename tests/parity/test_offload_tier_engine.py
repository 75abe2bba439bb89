"""The offload tier end to end on tiny random models (CPU fp32, offline `LLM`): chat sessions take
turns in a device pool too small for all of them, so later turns hit blocks the pool evicted and
the tier keeps; every token (greedy and seeded) equals a cold prefill and a warm device hit, and
the tier's hits are asserted non-zero, with async steps (every layout) and with synchronous ones
(two layouts), which steps ran checked by the scheduler's count of steps run ahead. Layouts:
sliding window (Gemma 3), KV sharing (Gemma 3n), Mamba-2 hybrid (Bamba), gated DeltaNet hybrid
(Qwen3.5) and short convolution (LFM2)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from scheduler.kv_cache.builder import block_bytes, request_blocks
from scheduler.output import ModelRunnerOutput, SchedulerOutput
from tests.helpers.engine_probe import num_scheduled_ahead
from tests.helpers.session_turns import session_turns
from tests.helpers.tiny_gemma3n import save_tiny_gemma3n
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import save_tiny_model

pytestmark = pytest.mark.parity
REPO_ROOT = Path(__file__).resolve().parents[2]

NUM_SESSIONS = 6
NUM_ROUNDS = 3
LLM_ARGS = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 32, "max_model_len": 64}
TIER = {"kv_offloading_size": 0.01}  # GiB: room for every session


def _save_gemma3n(path: Path) -> None:
    save_tiny_gemma3n(path, activation_sparsity_pattern=[0.0] * 6)


SAVERS: dict[str, Callable[[Path], object]] = {
    "gemma3": lambda path: save_tiny_model("gemma3", path),
    "gemma3n": _save_gemma3n,
    "bamba": lambda path: save_tiny_hybrid("bamba", path),
    "qwen3_5": lambda path: save_tiny_linear_hybrid("qwen3_5", path),
    "lfm2": lambda path: save_tiny_linear_hybrid("lfm2", path),
}
SPARE_BLOCKS = 4


def _sessions(path: Path, **kwargs: object) -> tuple[list[list[int]], LLM]:
    """Tokens of every turn, session after session in each round, and the (open) engine."""
    llm = LLM(str(path), **LLM_ARGS, **kwargs)
    return session_turns(llm, NUM_SESSIONS, NUM_ROUNDS), llm


def _small_pool(path: Path) -> dict[str, int]:
    """A KV budget of one longest request and a few blocks more (read from a throwaway engine's
    config): far less than the sessions' histories."""
    num_blocks, size = _pool_shape(path)
    return {"kv_cache_memory_bytes": num_blocks * size}


def _pool_shape(path: Path) -> tuple[int, int]:
    """(blocks of one longest request plus a few, bytes per block) of this model."""
    llm = LLM(str(path), **LLM_ARGS, kv_cache_memory_bytes=1 << 22)
    try:
        config = llm.client.core.scheduler.kv_cache_config  # type: ignore[attr-defined]
        num_blocks = request_blocks(config, LLM_ARGS["max_model_len"]) + SPARE_BLOCKS
        return num_blocks, block_bytes(config)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", list(SAVERS))
def test_tier_hits_give_the_tokens_of_a_cold_prefill_and_a_device_hit(
    family: str, tmp_path: Path
) -> None:
    SAVERS[family](tmp_path)
    small = _small_pool(tmp_path)
    cold, llm = _sessions(tmp_path, enable_prefix_caching=False)
    llm.shutdown()
    warm, llm = _sessions(tmp_path, kv_cache_memory_bytes=1 << 22)
    llm.shutdown()
    assert warm == cold
    tiered, llm = _sessions(tmp_path, **small, **TIER, async_scheduling=True)
    stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    ahead = num_scheduled_ahead(llm)
    llm.shutdown()
    assert tiered == cold
    assert ahead > 0  # the steps ran ahead of their tokens
    assert stats.offload is not None
    assert stats.offload.loaded_bytes > 0, stats.offload
    assert sum(stats.offload.group_hit_tokens) > 0
    assert stats.offload.num_failed_loads == 0


def test_a_failed_or_timed_out_load_recomputes(tmp_path: Path) -> None:
    """A load past its deadline (0 s) counts as failed: the request recomputes, tokens equal."""
    save_tiny_linear_hybrid("qwen3_5", tmp_path)
    small = _small_pool(tmp_path)
    cold, llm = _sessions(tmp_path, enable_prefix_caching=False)
    llm.shutdown()
    tiered, llm = _sessions(tmp_path, **small, **TIER, kv_offloading_load_timeout_s=0)
    stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    llm.shutdown()
    assert tiered == cold
    assert stats.offload is not None
    assert stats.offload.num_failed_loads > 0
    assert stats.offload.loaded_bytes == 0


def _sessions_in_a_process(model: Path, args: dict[str, object]) -> list[list[int]]:
    """`_sessions` in a process of its own (which exits before this one goes on)."""
    script = (
        "import json, sys\n"
        "from tests.parity.test_offload_tier_engine import _sessions\n"
        "tokens, llm = _sessions(sys.argv[1], **json.loads(sys.argv[2]))\n"
        "llm.shutdown()\n"
        "print(json.dumps(tokens))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(model), json.dumps(args)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _disk_tier(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    """A tiny gemma3 in `tmp_path/model` and engine args: a pool of its shape, a host tier of two
    blocks spilling to a disk tier in `tmp_path/kv`."""
    model = tmp_path / "model"
    save_tiny_model("gemma3", model)
    num_blocks, size = _pool_shape(model)
    args: dict[str, object] = {
        "kv_cache_memory_bytes": num_blocks * size,
        "kv_offloading_size": 2 * size / 2**30,
        "kv_offloading_dir": str(tmp_path / "kv"),
        "kv_offloading_disk_size": 0.01,
    }
    return model, args


def test_the_disk_tier_is_found_again_after_a_restart_and_bad_files_are_ignored(
    tmp_path: Path,
) -> None:
    """A host tier of two blocks spills to disk in another process; an engine in this process
    on the same folder hits the files (tokens equal); after every file is damaged, a third
    engine loads none and recomputes."""
    model, args = _disk_tier(tmp_path)
    cold, llm = _sessions(model, enable_prefix_caching=False)
    llm.shutdown()
    first = _sessions_in_a_process(model, args)
    assert first == cold
    files = sorted((tmp_path / "kv").rglob("*.kv"))
    assert files
    second, llm = _sessions(model, **args)
    stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    llm.shutdown()
    assert second == cold
    assert stats.offload.disk_loaded_bytes > 0
    for index, file in enumerate(sorted((tmp_path / "kv").rglob("*.kv"))):
        data = file.read_bytes()
        file.write_bytes(data[: len(data) // 2] if index % 2 else data[:-8] + b"garbage!")
    third, llm = _sessions(model, **args)
    stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    llm.shutdown()
    assert third == cold
    assert stats.offload.num_failed_loads > 0


@pytest.mark.parametrize("family", ["gemma3", "bamba"])
def test_tier_hits_with_synchronous_steps_give_the_tokens_of_a_cold_prefill(
    family: str, tmp_path: Path
) -> None:
    """The tier with synchronous steps (each scheduled after the previous one's tokens are
    back)."""
    SAVERS[family](tmp_path)
    small = _small_pool(tmp_path)
    cold, llm = _sessions(tmp_path, enable_prefix_caching=False)
    llm.shutdown()
    tiered, llm = _sessions(tmp_path, **small, **TIER, async_scheduling=False)
    stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    ahead = num_scheduled_ahead(llm)
    llm.shutdown()
    assert tiered == cold
    assert ahead == 0  # no step ran ahead of its tokens
    assert stats.offload is not None
    assert stats.offload.loaded_bytes > 0
    assert sum(stats.offload.group_hit_tokens) > 0
    assert stats.offload.num_failed_loads == 0


@pytest.mark.slow  # two tensor-parallel engines (minutes on a shared CPU); the ranks' agreement
# and shard files are in the default suite: tests/unit/worker/test_offload_ranks.py
def test_the_disk_tier_with_two_ranks_keeps_a_shard_per_rank_and_a_missing_shard_recomputes(
    tmp_path: Path,
) -> None:
    """Tensor parallel 2: each rank spills its own shard files (rank 1 in the fingerprint's
    folder with `-rank1`) and hits load them back (tokens equal); an engine restarted with rank
    1's files gone finds rank 0's alone, which are no hit: the loads fail on every rank and
    recompute."""
    model, args = _disk_tier(tmp_path)
    args["tensor_parallel_size"] = 2
    cold, llm = _sessions(model, enable_prefix_caching=False)
    llm.shutdown()
    first, llm = _sessions(model, **args)
    stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    llm.shutdown()
    assert first == cold
    assert stats.offload.disk_loaded_bytes > 0
    assert stats.offload.num_failed_loads == 0
    (rank0,) = [p for p in (tmp_path / "kv").iterdir() if not p.name.endswith("-rank1")]
    rank1 = rank0.with_name(f"{rank0.name}-rank1")
    assert sorted(p.name for p in rank0.glob("*.kv")) == sorted(p.name for p in rank1.glob("*.kv"))
    assert list(rank0.glob("*.kv"))
    for file in rank1.glob("*.kv"):
        file.unlink()
    second, llm = _sessions(model, **args)
    stats = llm.client.core.get_stats()  # type: ignore[attr-defined]
    llm.shutdown()
    assert second == cold
    assert stats.offload.num_failed_loads > 0


def test_a_step_runs_other_requests_while_a_tier_hit_loads(tmp_path: Path) -> None:
    """The worker's copy thread is held: the request whose hit is in the tier waits for its
    loads, counted as waiting for KV, while a request that arrived with it runs; once the copy
    thread goes on, the waiting request runs too, and both give the tokens of a cold prefill."""
    save_tiny_model("gemma3", tmp_path)
    small = _small_pool(tmp_path)
    history = [(7 * i) % 250 + 1 for i in range(40)]
    others = [[(11 * i + 3 * s) % 250 + 1 for i in range(40)] for s in range(1, 4)]
    later = [{"prompt_token_ids": [*history, 9, 8, 7]}, {"prompt_token_ids": [5] * 20}]
    greedy = SamplingParams(temperature=0, max_tokens=4)
    llm = LLM(str(tmp_path), **LLM_ARGS, enable_prefix_caching=False)
    cold = [list(r.outputs[0].token_ids) for r in llm.generate(later, greedy, use_tqdm=False)]
    llm.shutdown()
    llm = LLM(str(tmp_path), **LLM_ARGS, **small, **TIER)
    core = llm.client.core  # type: ignore[attr-defined]
    for prompt in [history, *others]:  # the later turns push the history into the tier
        llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    release = threading.Event()
    store = core.executor.worker.model_runner.offload
    store.disk_io.load("gate", [], lambda _: release.wait(30))
    steps: list[tuple[set[str], set[str], int]] = []
    execute = core.executor.execute

    def recording(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        stats = core.scheduler.make_stats()
        scheduled = set(scheduler_output.num_scheduled_tokens)
        steps.append((scheduled, set(core.scheduler.loading), stats.num_waiting_for_kv_reqs))
        if scheduled and core.scheduler.loading:
            release.set()  # another request ran while one waited for its loads
        return execute(scheduler_output)

    core.executor.execute = recording
    try:
        outputs = llm.generate(later, greedy, use_tqdm=False)
        stats = core.get_stats()
    finally:
        release.set()
        llm.shutdown()
    assert [list(r.outputs[0].token_ids) for r in outputs] == cold
    assert stats.offload.loaded_bytes > 0
    overlapping = [s for s in steps if s[0] and s[1]]
    assert overlapping, steps
    scheduled, loading, num_waiting_for_kv = overlapping[0]
    assert not scheduled & loading
    assert num_waiting_for_kv == len(loading) == 1

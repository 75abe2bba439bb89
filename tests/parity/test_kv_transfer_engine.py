"""KV transfer between two engines in one process, on tiny random models (CPU fp32): the sender
computes a prompt's prefix (all but the last token, as a prefill side does), its minimal hybrid
set moves into the receiver's pool, and the receiver's tokens (greedy and seeded) equal those of
one engine with no cache, while it computes only the tail. Layouts: sliding window (Gemma 3), KV
sharing (Gemma 3n), Mamba-2 hybrid (Bamba), gated DeltaNet hybrid (Qwen3.5); prefix caching on at
both ends, with and without part of the prefix already held by the receiver. A one-rank receiver
handed a two-rank sender's shards reshards them (engines of two sizes: the reshard tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.core import EngineCore
from cluster.engine.kv_transfer import (
    kv_export,
    kv_held_keys,
    kv_import,
    prompt_probe,
    transfer_prefix,
)
from scheduler.kv_cache.transfer import hit_lower_bound_bytes
from tests.helpers.tiny_gemma3n import save_tiny_gemma3n
from tests.helpers.tiny_hybrid import save_tiny_hybrid
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.tiny_models import save_tiny_model
from worker.kv_io.kv_transfer import GroupLayouts, KVShard, group_layouts

pytestmark = pytest.mark.parity

LLM_ARGS = {"block_size": 4, "max_num_batched_tokens": 64, "max_model_len": 128}
SAVERS: dict[str, Callable[[Path], object]] = {
    "gemma3": lambda path: save_tiny_model("gemma3", path),
    "gemma3n": lambda path: save_tiny_gemma3n(path, activation_sparsity_pattern=[0.0] * 6),
    "bamba": lambda path: save_tiny_hybrid("bamba", path),
    "qwen3_5": lambda path: save_tiny_linear_hybrid("qwen3_5", path),
}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(61)]
SHARED = 24
"""Tokens of `PROMPT` the receiver already holds in the partial case."""
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=6),
    "seeded": SamplingParams(temperature=1.0, max_tokens=6, seed=7),
}


def core_of(llm: LLM) -> EngineCore:
    return llm.client.core  # type: ignore[attr-defined, no-any-return]


def generate(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    (result,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(result.outputs[0].token_ids)


def prefill_all_but_last(llm: LLM, prompt: list[int]) -> None:
    """What a prefill side computes: every prompt token but the last (cached on exit)."""
    generate(llm, prompt[:-1], SamplingParams(temperature=0, max_tokens=1))


@pytest.fixture(scope="module", params=list(SAVERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    SAVERS[request.param](path)
    return path


@pytest.fixture(scope="module")
def cold_tokens(family: Path) -> dict[str, list[int]]:
    llm = LLM(str(family), **LLM_ARGS, enable_prefix_caching=False)
    try:
        return {name: generate(llm, PROMPT, params) for name, params in PARAMS.items()}
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("receiver_holds_part", "transport"),
    [(False, "object_store"), (True, "object_store"), (True, "direct")],
    ids=["empty", "partial", "partial-direct"],
)
def test_tokens_after_a_transfer_equal_one_engine(
    family: Path, cold_tokens: dict[str, list[int]], receiver_holds_part: bool, transport: str
) -> None:
    sender = LLM(str(family), **LLM_ARGS, kv_transfer_transport=transport)
    receiver = LLM(str(family), **LLM_ARGS)
    try:
        prefill_all_but_last(sender, PROMPT)
        if receiver_holds_part:
            prefill_all_but_last(receiver, [*PROMPT[:SHARED], 9, 9, 9, 9, 9])
        send, take = core_of(sender), core_of(receiver)
        held = kv_held_keys(take, PROMPT)
        transfer = kv_export(send, PROMPT, held)
        keys = transfer.keys
        assert keys.num_blocks > 0
        assert (keys.num_held_blocks > 0) == receiver_holds_part
        bound = hit_lower_bound_bytes(send.scheduler.kv_cache_config, keys.num_hit_tokens)
        if not receiver_holds_part:  # the whole minimal set travels, nothing more
            assert transfer.nbytes <= 1.05 * bound, (transfer.nbytes, bound)
        else:
            assert transfer.nbytes < bound
        assert transfer.is_offered == (transport == "direct")
        result = kv_import(take, transfer)
        assert result.num_blocks == keys.num_blocks
        before = take.get_stats().prefix_cache_hit_tokens
        tokens = {name: generate(receiver, PROMPT, params) for name, params in PARAMS.items()}
        first_hit = take.get_stats().prefix_cache_hit_tokens - before
        assert first_hit >= 2 * keys.num_hit_tokens  # both lookups hit the transferred prefix
        assert tokens == cold_tokens
        counters = take.kv_transfer_counters
        assert sum(counters.blocks_received) == keys.num_blocks
        assert sum(send.kv_transfer_counters.bytes_sent) == transfer.nbytes
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_transfer_between_other_kv_layouts_is_refused(tmp_path: Path) -> None:
    save_tiny_model("gemma3", tmp_path)
    sender = LLM(str(tmp_path), **LLM_ARGS)
    receiver = LLM(str(tmp_path), **{**LLM_ARGS, "block_size": 8})
    try:
        prefill_all_but_last(sender, PROMPT)
        with pytest.raises(ValueError, match="kv transfer: the engines differ"):
            transfer_prefix(core_of(sender), core_of(receiver), PROMPT)
    finally:
        sender.shutdown()
        receiver.shutdown()


def _shard_of_rank(shard: KVShard, layouts: GroupLayouts, tp_size: int, rank: int) -> KVShard:
    """What rank `rank` of a `tp_size`-rank sender would send, cut from one rank's shard."""
    pages = tuple(
        replace(
            pages,
            tensors=tuple(
                owner.layout.cut(tensor, tp_size, rank)  # type: ignore[union-attr]
                for tensor, owner in zip(pages.tensors, layouts[pages.group_id], strict=True)
            ),
        )
        for pages in shard.pages
    )
    return KVShard(rank, pages)


def test_shards_of_other_tensor_parallel_sizes_are_resharded_or_refused(tmp_path: Path) -> None:
    """A one-rank receiver handed the shards of a two-rank sender (each page cut as that rank
    holds it: Mamba heads split, its one B/C group on both ranks) rebuilds its pages and decodes
    as one engine; three ranks' shards cannot hold four Mamba heads: refused naming the group
    and the layer type, and nothing is kept."""
    save_tiny_hybrid("bamba", tmp_path)
    cold = LLM(str(tmp_path), **LLM_ARGS, enable_prefix_caching=False)
    sender, receiver = LLM(str(tmp_path), **LLM_ARGS), LLM(str(tmp_path), **LLM_ARGS)
    try:
        expected = generate(cold, PROMPT, PARAMS["greedy"])
        prefill_all_but_last(sender, PROMPT)
        send, take = core_of(sender), core_of(receiver)
        transfer = kv_export(send, PROMPT, kv_held_keys(take, PROMPT))
        runner = take.executor.worker.model_runner  # type: ignore[attr-defined]
        layers = [*runner.layers, *runner.mamba_layers]
        layouts = group_layouts(take.scheduler.kv_cache_config, runner.kv_caches, layers)
        three = replace(
            transfer, shards=tuple(replace(transfer.shards[0], rank=r) for r in range(3))
        )
        with pytest.raises(
            ValueError, match=r"cannot reshard KV cache group \d \(MambaMixer2 layer"
        ):
            kv_import(take, three)
        assert take.scheduler.kv_cache_manager.usage == 0
        shards = tuple(_shard_of_rank(transfer.shards[0], layouts, 2, r) for r in range(2))
        assert (
            kv_import(take, replace(transfer, shards=shards)).num_blocks == transfer.keys.num_blocks
        )
        assert generate(receiver, PROMPT, PARAMS["greedy"]) == expected
        assert take.get_stats().prefix_cache_hit_tokens == transfer.keys.num_hit_tokens
    finally:
        cold.shutdown()
        sender.shutdown()
        receiver.shutdown()


@pytest.mark.slow  # four spawned rank processes
def test_tensor_parallel_ranks_send_their_own_shards(tmp_path: Path) -> None:
    """Two ranks per engine (spawned processes): each rank's shard goes to the same rank."""
    save_tiny_hybrid("bamba", tmp_path)
    tp = {**LLM_ARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    cold = LLM(str(tmp_path), **LLM_ARGS, enable_prefix_caching=False)
    try:
        expected = generate(cold, PROMPT, PARAMS["greedy"])
    finally:
        cold.shutdown()
    sender, receiver = LLM(str(tmp_path), **tp), LLM(str(tmp_path), **tp)
    try:
        prefill_all_but_last(sender, PROMPT)
        send, take = core_of(sender), core_of(receiver)
        transfer = kv_export(send, PROMPT, kv_held_keys(take, PROMPT))
        assert [shard.rank for shard in transfer.shards] == [0, 1]
        half = transfer.shards[0].nbytes
        assert half == transfer.shards[1].nbytes == transfer.nbytes // 2
        kv_import(take, transfer)
        assert generate(receiver, PROMPT, PARAMS["greedy"]) == expected
        assert take.get_stats().prefix_cache_hit_tokens == transfer.keys.num_hit_tokens
    finally:
        sender.shutdown()
        receiver.shutdown()


def lookup_hits(llm: LLM, prompt: list[int]) -> tuple[int, int]:
    """The prefix-cache hit the engine's scheduler would give the prompt now (nothing run), and
    the one on the block grid alone (what a router's index of its KV events predicts)."""
    core = core_of(llm)
    probe = prompt_probe(core, prompt)
    manager = core.scheduler.kv_cache_manager
    grid = manager.coordinator.find_longest_cache_hit(probe.block_hashes, len(prompt) - 1)
    return manager.get_computed_blocks(probe).num_tokens, grid.num_tokens


@pytest.mark.parametrize("family", ["bamba"], indirect=True)
def test_a_pulled_conversation_resumes_where_its_sender_would(family: Path) -> None:
    """A conversation pulled as the drain hand-off pulls it (to its prompt's end, then to its
    answer's) resumes on the receiver where it would on the sender: at the sender's state
    checkpoints (prompt end and answer end, off the 12-token hybrid block grid), not a block
    earlier; its block-grid hit (a router's prediction) is the sender's too; and the next
    turn's tokens equal one engine's with no cache."""
    sender, receiver = LLM(str(family), **LLM_ARGS), LLM(str(family), **LLM_ARGS)
    cold = LLM(str(family), **LLM_ARGS, enable_prefix_caching=False)
    try:
        prompt = PROMPT[:35]
        turn = [*prompt, *generate(sender, prompt, SamplingParams(temperature=0, max_tokens=8))]
        for end in (len(prompt), len(turn)):
            transfer_prefix(core_of(sender), core_of(receiver), turn[:end])
        regenerated, next_turn = [*prompt, 5, 6], [*turn, 11, 12, 13, 14, 15, 16, 17]
        alignment = core_of(sender).scheduler.kv_cache_manager.alignment_tokens
        for follow_up in (regenerated, next_turn):
            own_hit, own_grid_hit = lookup_hits(sender, follow_up)
            assert own_hit % alignment, own_hit  # the sender resumes at a checkpoint
            assert lookup_hits(receiver, follow_up) == (own_hit, own_grid_hit)
        before = core_of(receiver).get_stats().prefix_cache_hit_tokens
        tokens = generate(receiver, next_turn, PARAMS["greedy"])
        assert core_of(receiver).get_stats().prefix_cache_hit_tokens - before == own_hit
        assert tokens == generate(cold, next_turn, PARAMS["greedy"])
    finally:
        sender.shutdown()
        receiver.shutdown()
        cold.shutdown()

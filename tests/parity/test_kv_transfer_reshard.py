"""KV transfer between engines of different tensor-parallel sizes (one rank and two spawned
ranks, CPU fp32): the sender's shards travel as its ranks wrote them, the receiver's ranks
reshard them, and the receiver then hits the transferred prefix and decodes the greedy tokens of
a recompute and of transformers. Layouts: full + sliding attention, KV heads split (Gemma 3),
Mamba-2 with one B/C group replicated (Bamba), gated DeltaNet (Qwen3.5). KV heads replicated
on both ranks are checked against the layers' weights in the worker's layout tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.core import EngineCore
from cluster.engine.kv_transfer import kv_export, kv_held_keys, kv_import
from tests.helpers.reshard_models import RESHARD_FAMILIES
from tests.helpers.tiny_models import hf_greedy

pytestmark = pytest.mark.parity

LLM_ARGS = {"max_num_batched_tokens": 64, "max_model_len": 128}
PROMPTS = ([(7 * i + 3) % 250 + 1 for i in range(53)], [(5 * i + 11) % 250 + 1 for i in range(47)])
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def core_of(llm: LLM) -> EngineCore:
    return llm.client.core  # type: ignore[attr-defined, no-any-return]


def generate(llm: LLM, prompt: list[int]) -> list[int]:
    (result,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    return list(result.outputs[0].token_ids)


def move_and_decode(sender: LLM, receiver: LLM, prompt: list[int]) -> tuple[list[int], list[int]]:
    """The sender computes the prompt (cached), its prefix moves; (sender's, receiver's) tokens."""
    computed = generate(sender, prompt)
    send, take = core_of(sender), core_of(receiver)
    transfer = kv_export(send, prompt, kv_held_keys(take, prompt))
    num_ranks = send.executor.configs.tensor_parallel_size
    assert [shard.rank for shard in transfer.shards] == list(range(num_ranks))
    assert transfer.nbytes == num_ranks * transfer.shards[0].nbytes  # each rank its own shard
    assert kv_import(take, transfer).num_blocks == transfer.keys.num_blocks > 0
    before = take.get_stats().prefix_cache_hit_tokens
    received = generate(receiver, prompt)
    hit = take.get_stats().prefix_cache_hit_tokens - before
    assert hit == transfer.keys.num_hit_tokens >= len(prompt) // 2
    return computed, received


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(RESHARD_FAMILIES))
def test_transfers_between_one_and_two_ranks_decode_transformers_tokens(
    family: str, tmp_path: Path
) -> None:
    save, block_size = RESHARD_FAMILIES[family]
    hf_model = save(tmp_path)
    args = {**LLM_ARGS, "block_size": block_size}
    one = LLM(str(tmp_path), **args)
    two = LLM(str(tmp_path), **args, tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert core_of(one).kv_transfer_fingerprint == core_of(two).kv_transfer_fingerprint
        for sender, receiver, prompt in ((one, two, PROMPTS[0]), (two, one, PROMPTS[1])):
            computed, received = move_and_decode(sender, receiver, prompt)
            assert received == computed == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
    finally:
        one.shutdown()
        two.shutdown()

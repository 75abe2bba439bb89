"""The scheduler's side of a KV transfer, on hybrid layouts without a model: the sender's set is
the hybrid minimum of its hit (its bytes the lower bound), keys the receiver holds are left out,
an import registers every key so the receiver's lookup hits the sender's length, a failed or
roomless import leaves the pool as it was, and a sender whose conversation moved evicts what it
sent first."""

from __future__ import annotations

import pytest

from scheduler.kv_cache.manager import KVCacheManager
from scheduler.kv_cache.spec import KVCacheSpec, MambaCacheMode
from scheduler.kv_cache.spec_factory import (
    AttentionShape,
    MambaShape,
    make_spec,
    one_layer_groups_config,
)
from scheduler.kv_cache.transfer import (
    abort_import,
    commit_import,
    demote_export,
    find_export,
    held_keys,
    needed_blocks,
    reserve_import,
    transfer_fingerprint,
)
from scheduler.request import Request, SamplingParams

LAYOUTS: dict[str, list[KVCacheSpec]] = {
    "sliding+full": [make_spec("full_attention", 16), make_spec("sliding_window", 16, 64)],
    "mamba+full": [
        make_spec("full_attention", 16),
        make_spec("mamba", 16, mamba_cache_mode=MambaCacheMode.ALIGN),
    ],
}
PROMPT = [(13 * i + 5) % 1000 + 1 for i in range(200)]


def _manager(layout: str, num_blocks: int = 200) -> KVCacheManager:
    config = one_layer_groups_config(num_blocks, LAYOUTS[layout])
    return KVCacheManager(config, max_model_len=1024)


def _request(prompt: list[int], manager: KVCacheManager, name: str = "r") -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=1), manager.hash_block_size)


def _compute(manager: KVCacheManager, prompt: list[int]) -> None:
    """Run a prompt through the cache in chunks ending on block boundaries (as the scheduler
    splits a Mamba prefill), then free it (its blocks stay cached)."""
    request = _request(prompt, manager, f"c{len(prompt)}")
    hit = manager.get_computed_blocks(request)
    aligned = len(prompt) // manager.alignment_tokens * manager.alignment_tokens
    manager.allocate_slots(request, aligned - hit.num_tokens, hit.num_tokens, hit.blocks)
    request.num_computed_tokens = aligned
    manager.allocate_slots(request, len(prompt) - aligned)
    request.num_computed_tokens = len(prompt)
    manager.allocate_slots(request, 0)
    manager.free(request)


def _hit(manager: KVCacheManager, prompt: list[int]) -> int:
    return manager.get_computed_blocks(_request(prompt, manager)).num_tokens


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("receiver_holds", [0, 64])
def test_the_receiver_hits_what_the_sender_had(layout: str, receiver_holds: int) -> None:
    sender, receiver = _manager(layout), _manager(layout)
    _compute(sender, PROMPT[:-1])
    if receiver_holds:
        _compute(receiver, [*PROMPT[:receiver_holds], 7, 7, 7])
    hashes = _request(PROMPT, sender).block_hashes
    held = held_keys(receiver, hashes, "f")
    plan = find_export(sender, hashes, len(PROMPT) - 1, held, "f")
    hit = plan.keys.num_hit_tokens
    assert hit == _hit(sender, PROMPT) > 0
    config = sender.coordinator.group_specs
    needed = sum(needed_blocks(spec, hit) for spec in config)
    assert plan.keys.num_blocks + plan.keys.num_held_blocks == needed
    assert (plan.keys.num_held_blocks > 0) == bool(receiver_holds)
    reservation = reserve_import(receiver, plan.keys)
    assert reservation is not None
    commit_import(receiver, reservation)
    assert _hit(receiver, PROMPT) == hit
    assert receiver.usage == 0
    receiver.check_invariants()


def test_a_failed_or_roomless_import_leaves_the_pool_as_it_was() -> None:
    sender, receiver = _manager("sliding+full"), _manager("sliding+full", num_blocks=4)
    _compute(sender, PROMPT[:-1])
    hashes = _request(PROMPT, sender).block_hashes
    plan = find_export(sender, hashes, len(PROMPT) - 1, held_keys(receiver, hashes, "f"), "f")
    assert reserve_import(receiver, plan.keys) is None
    roomy = _manager("sliding+full")
    reservation = reserve_import(roomy, plan.keys)
    assert reservation is not None
    assert roomy.usage > 0
    abort_import(roomy, reservation)
    assert roomy.usage == 0
    assert _hit(roomy, PROMPT) == 0
    roomy.check_invariants()


def test_engines_of_other_layouts_are_refused() -> None:
    sender, receiver = _manager("sliding+full"), _manager("sliding+full")
    hashes = _request(PROMPT, sender).block_hashes
    with pytest.raises(ValueError, match="differ in model, KV layout or cache dtypes"):
        find_export(sender, hashes, 100, held_keys(receiver, hashes, "a"), "b")


def _rank_layout(heads: int, block_size: int = 16) -> list[KVCacheSpec]:
    """One rank's specs of a full + Mamba model whose heads and channels `heads` count."""
    state = MambaShape(((heads * 8, 3), (heads, 4, 8)), (4, 4))
    return [
        make_spec("full_attention", block_size, shape=AttentionShape(heads, 16, 4)),
        make_spec("mamba", block_size, shape=state),
    ]


def test_the_transfer_fingerprint_leaves_out_what_tensor_parallelism_divides() -> None:
    """One model at one and at two ranks (halved heads and states, another pool size) has one
    fingerprint; another block size or another model has another."""

    def fingerprint(specs: list[KVCacheSpec], num_blocks: int = 200, model: str = "m") -> str:
        return transfer_fingerprint(one_layer_groups_config(num_blocks, specs), model)

    assert fingerprint(_rank_layout(4)) == fingerprint(_rank_layout(2), num_blocks=400)
    assert fingerprint(_rank_layout(4)) != fingerprint(_rank_layout(4, block_size=32))
    assert fingerprint(_rank_layout(4)) != fingerprint(_rank_layout(4), model="other")
    sliding = [make_spec("sliding_window", 16, 64, shape=AttentionShape(4, 16, 4))]
    assert fingerprint(_rank_layout(4)[:1]) != fingerprint(sliding)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_sender_evicts_what_it_sent_first(layout: str) -> None:
    """The moved conversation's blocks go to the front of the sender's eviction order: the
    blocks the next requests take are those, and another conversation's prefix, though older,
    stays cached."""
    sender, receiver = _manager(layout), _manager(layout)
    other = [7, *PROMPT[1:100]]
    _compute(sender, other)
    _compute(sender, PROMPT[:-1])
    hashes = _request(PROMPT, sender).block_hashes
    plan = find_export(sender, hashes, len(PROMPT) - 1, held_keys(receiver, hashes, "f"), "f")
    other_hit = _hit(sender, [*other, 1])
    assert demote_export(sender, plan) == plan.keys.num_blocks > 0
    sent = {block_id for group in plan.block_ids for block_id in group}
    front = sender.pool.free_queue.eviction_order(len(sent))
    assert {block.block_id for block in front} == sent
    sender.pool.get_new_blocks(len(sent), 0)
    assert _hit(sender, PROMPT) < plan.keys.num_hit_tokens
    assert _hit(sender, [*other, 1]) == other_hit > 0


def test_blocks_a_running_request_holds_are_not_demoted() -> None:
    sender, receiver = _manager("sliding+full"), _manager("sliding+full")
    _compute(sender, PROMPT[:-1])
    hashes = _request(PROMPT, sender).block_hashes
    plan = find_export(sender, hashes, len(PROMPT) - 1, held_keys(receiver, hashes, "f"), "f")
    running = _request(PROMPT, sender, "running")
    hit = sender.get_computed_blocks(running)
    sender.allocate_slots(running, 1, hit.num_tokens, hit.blocks)
    assert demote_export(sender, plan) == 0
    sender.check_invariants()

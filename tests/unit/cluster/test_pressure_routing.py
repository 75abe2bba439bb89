"""Pool pressure: a conversation continuing on a replica that evicts much more of its pool than
another leaves for the calmest one, and the router names its old replica as the source to pull
its prefix from; below the pressure floor, or with the rule off, it stays."""

from __future__ import annotations

import pytest

from cluster.serve.hybrid_policy import HybridRoutingPolicy, PromptKeys, PullHint
from cluster.serve.routing_options import RoutingOptions
from scheduler.kv_cache.events import KVEventBatch, KVEventWindow
from tests.helpers.routing_cases import GROUPS, PROMPT

NUM_BLOCKS = 32


def _window(first_seq: int, stored: list[bytes] = (), removed: int = 0) -> KVEventWindow:
    """One batch storing `stored` in both groups and removing `removed` keys of the full
    group, from a replica of `NUM_BLOCKS` blocks."""
    evicted = tuple(bytes([n]) * 8 for n in range(removed))
    batch = KVEventBatch(stored=(tuple(stored), tuple(stored)), removed=(evicted, ()))
    return KVEventWindow(GROUPS, first_seq, (batch,), num_blocks=NUM_BLOCKS)


def _conversation_on_a(
    evicted_on_a: int, evicted_elsewhere: int = 1, **options: float | None
) -> tuple[HybridRoutingPolicy[str], PromptKeys]:
    """Replica a caches `PROMPT` (routed there) and then evicts `evicted_on_a` keys; b evicts
    `evicted_elsewhere`, c one more. Returns the policy and the conversation's next prompt."""
    policy: HybridRoutingPolicy[str] = HybridRoutingPolicy(RoutingOptions(**options))
    for key in "abc":
        policy.replay(key, _window(0))
    first = policy.prompt_keys(PROMPT, None)
    policy.routed("a", first, 0.0)
    policy.completed("a")
    policy.replay("a", _window(1, first.block_hashes), now=0.5)
    policy.replay("a", _window(2, removed=evicted_on_a), now=1.0)
    policy.replay("b", _window(1, removed=evicted_elsewhere), now=1.0)
    policy.replay("c", _window(1, removed=evicted_elsewhere + 1), now=1.0)
    return policy, policy.prompt_keys([*PROMPT, 7, 8, 9, 10, 11], None)


def test_a_conversation_leaves_a_replica_under_pressure_and_pulls_its_prefix() -> None:
    policy, follow_up = _conversation_on_a(evicted_on_a=16)
    chosen = policy.choose(["a", "b", "c"], follow_up, 1.0)[0]
    assert chosen == ["b"]  # the calmest
    assert policy.pull_source("b", follow_up, 1.0, threshold=16) == PullHint("a", 40, 40)


@pytest.mark.parametrize(
    ("evicted_on_a", "evicted_elsewhere", "options"),
    [(16, 10, {}), (16, 1, {"pressure_factor": None}), (4, 0, {})],
    ids=["evicts-like-the-others", "rule-off", "below-the-floor"],
)
def test_a_conversation_stays_without_pressure(
    evicted_on_a: int, evicted_elsewhere: int, options: dict[str, float | None]
) -> None:
    policy, follow_up = _conversation_on_a(evicted_on_a, evicted_elsewhere, **options)
    assert policy.choose(["a", "b", "c"], follow_up, 1.0)[0] == ["a"]


def test_bad_pressure_options_name_their_key() -> None:
    with pytest.raises(ValueError, match="pressure_factor"):
        RoutingOptions(pressure_factor=0.5)
    with pytest.raises(ValueError, match="min_pressure"):
        RoutingOptions(min_pressure=-1)
    with pytest.raises(ValueError, match="pressure_half_life_s"):
        RoutingOptions(pressure_half_life_s=0)

"""How the hybrid routing policy spreads conversations: each counts once, with its latest
prompt, wherever it went; new ones go where the fewest are."""

from __future__ import annotations

import pytest

from cluster.serve.hybrid_policy import HybridRoutingPolicy
from scheduler.kv_cache.events import KVEventBatch, KVEventWindow
from tests.helpers.routing_cases import GROUPS, PROMPT, make_policy, window_of

REPLICAS = ["a", "b", "c"]


def turns(first: list[int], count: int) -> list[list[int]]:
    """A conversation's prompts: each repeats the previous one and adds 8 tokens."""
    prompts = [first]
    for number in range(count - 1):
        prompts.append([*prompts[-1], *range(1000 + 8 * number, 1008 + 8 * number)])
    return prompts


def route(policy: HybridRoutingPolicy[str], replica: str, prompt: list[int], now: float) -> None:
    policy.routed(replica, policy.prompt_keys(prompt, None), now)
    policy.completed(replica)


def test_a_conversation_counts_once_and_new_ones_go_where_the_fewest_are() -> None:
    """Replica a served one conversation of four turns, b two short ones, c one long one: a and
    c hold fewer conversations than b (though more prompt tokens were sent to a than to b), and
    a holds the fewer tokens of its latest prompts: a new conversation goes to a."""
    policy = make_policy()
    for now, prompt in enumerate(turns(PROMPT, 4)):
        route(policy, "a", prompt, float(now))
    route(policy, "b", list(range(300, 330)), 4.0)
    route(policy, "b", list(range(400, 430)), 4.0)
    route(policy, "c", list(range(2000, 2150)), 4.0)
    cases = {key: policy.candidate(key, None, 4.0) for key in REPLICAS}
    assert [round(cases[key].conversations) for key in REPLICAS] == [1, 2, 1]
    assert cases["a"].recent_work == pytest.approx(len(PROMPT) + 24, rel=0.02)  # latest turn
    new = policy.prompt_keys(list(range(500, 540)), None)
    assert policy.choose(REPLICAS, new, 4.0)[0] == ["a"]


def test_a_shared_prefix_every_replica_holds_does_not_decide() -> None:
    """Every replica holds the system prompt (most of a new conversation's prompt): the new
    conversation goes where the fewest conversations are, not where the fewest requests run."""
    policy = make_policy()
    keys = policy.prompt_keys(PROMPT, None)
    system = keys.block_hashes[:8]  # 32 tokens
    for replica in REPLICAS:
        policy.replay(replica, window_of(system, system))
    route(policy, "a", [*PROMPT[:32], *range(600, 610)], 0.0)
    route(policy, "a", [*PROMPT[:32], *range(700, 710)], 0.0)
    route(policy, "c", [*PROMPT[:32], *range(800, 810)], 0.0)
    policy.routed("b", policy.prompt_keys([*PROMPT[:32], *range(900, 910)], None), 0.0)
    policy.routed("c", policy.prompt_keys([*PROMPT[:32], *range(950, 960)], None), 0.0)
    new = policy.prompt_keys([*PROMPT[:32], *range(100, 110)], None)
    hits = {key: policy.predicted_hit(key, new, 1.0) for key in REPLICAS}
    assert hits == {"a": 32, "b": 32, "c": 32}
    assert [policy.in_flight(key) for key in REPLICAS] == [0, 1, 1]
    assert policy.choose(REPLICAS, new, 1.0)[0] == ["b"]  # one conversation; a and c have two


def test_prompts_routed_before_the_first_events_count_as_their_conversations() -> None:
    """The first turn went to a before a's first events (nothing to hash with then); its second
    turn, routed after, is the same conversation: a holds one, not two."""
    policy: HybridRoutingPolicy[str] = HybridRoutingPolicy()
    first, second = turns(PROMPT, 2)
    route(policy, "a", first, 0.0)
    policy.replay("a", window_of([], [], first_seq=0))
    route(policy, "a", second, 1.0)
    assert round(policy.candidate("a", None, 1.0).conversations) == 1


def test_a_conversation_returns_to_its_replica_after_its_cache_there_is_gone() -> None:
    """Nothing of the conversation is cached on a any more (the events removed it all); its
    next turn still goes back to a, where it is the conversation's chain that a keeps next."""
    policy = make_policy()
    first, second = turns(PROMPT, 2)
    route(policy, "a", first, 0.0)
    route(policy, "b", list(range(300, 340)), 0.0)
    gone = tuple(policy.prompt_keys(first, None).block_hashes)
    removal = KVEventBatch(stored=((), ()), removed=(gone, gone))
    policy.replay("a", KVEventWindow(GROUPS, 1, (removal,)))
    keys = policy.prompt_keys(second, None)
    assert policy.predicted_hit("a", keys, 1.0) == 0
    assert policy.choose(REPLICAS, keys, 1.0)[0] == ["a"]

"""LoRA adapters in the hybrid routing policy: hits per adapter, and adapters drawn to the
replicas that have them loaded, within the load bound."""

from __future__ import annotations

from cluster.serve.hybrid_policy import HybridRoutingPolicy, PromptKeys
from scheduler.lora import prefix_salt
from tests.helpers.routing_cases import PROMPT, make_policy, window_of

REPLICAS = ["a", "b"]


def _keys_for(
    policy: HybridRoutingPolicy[str], token_ids: list[int], adapter: str | None
) -> PromptKeys:
    """The prompt as the router hands it over: hashed with the adapter in its block-0 key."""
    return policy.prompt_keys(token_ids, prefix_salt(None, adapter), adapter)


def test_a_new_conversation_goes_where_its_adapter_is_loaded() -> None:
    """b reports the adapter; a is idler (fewer conversations), yet b gets the request; a base
    request still goes to the idler replica."""
    policy = make_policy()
    policy.replay("b", window_of([], [], first_seq=0), adapters=["sql"])
    busy = policy.prompt_keys([200, *PROMPT], None)
    policy.routed("b", busy, 0.0)
    policy.completed("b")
    keys = _keys_for(policy, PROMPT, "sql")
    assert policy.choose(REPLICAS, keys, 1.0)[0] == ["b"]
    base = policy.prompt_keys(PROMPT, None)
    assert policy.choose(REPLICAS, base, 1.0)[0] == ["a"]


def test_the_second_request_of_an_adapter_follows_the_first() -> None:
    """Before any replica reports it, the adapter of a request just routed counts as loaded
    where it went: two unrelated prompts of one adapter land together, two of the base model
    spread."""
    for adapter, together in (("sql", True), (None, False)):
        policy = make_policy()
        first = _keys_for(policy, PROMPT, adapter)
        chosen = policy.choose(REPLICAS, first, 0.0)[0][0]
        policy.routed(chosen, first, 0.0)
        policy.completed(chosen)
        second = _keys_for(policy, [150 + i for i in range(30)], adapter)
        assert (policy.choose(REPLICAS, second, 1.0)[0] == [chosen]) is together, adapter


def test_a_reported_unload_ends_the_pull() -> None:
    policy = make_policy(guess_ttl_s=0.5)
    policy.replay("b", window_of([], [], first_seq=0), adapters=["sql"])
    policy.routed("b", policy.prompt_keys([200, *PROMPT], None), 0.0)
    keys = _keys_for(policy, PROMPT, "sql")
    assert policy.choose(REPLICAS, keys, 1.0)[0] == ["b"]
    policy.replay("b", window_of([], [], first_seq=1), adapters=[])
    assert policy.choose(REPLICAS, keys, 1.0)[0] == ["a"]


def test_a_prefix_hit_counts_with_its_own_adapter_only() -> None:
    """a caches the prompt under adapter sql: a sql request hits there, a request of another
    adapter (loaded on b) or of the base model does not."""
    policy = make_policy()
    sql = _keys_for(policy, PROMPT, "sql")
    policy.replay("a", window_of(sql.block_hashes, sql.block_hashes), adapters=["sql"])
    policy.replay("b", window_of([], [], first_seq=0), adapters=["chat"])
    assert policy.predicted_hit("a", sql, 0.0) == 40
    assert policy.choose(REPLICAS, sql, 0.0)[0] == ["a"]
    chat = _keys_for(policy, PROMPT, "chat")
    assert policy.predicted_hit("a", chat, 0.0) == 0
    assert policy.choose(REPLICAS, chat, 0.0)[0] == ["b"]


def test_the_load_bound_overrides_the_adapter() -> None:
    """The replica with the adapter is full (in flight at the bound): the other one takes the
    request (and loads the adapter)."""
    policy = make_policy(load_factor=1.0, min_in_flight_bound=1)
    policy.replay("b", window_of([], [], first_seq=0), adapters=["sql"])
    policy.routed("b", policy.prompt_keys([200, *PROMPT], None), 0.0)
    keys = _keys_for(policy, PROMPT, "sql")
    assert policy.choose(REPLICAS, keys, 1.0)[0] == ["a"]

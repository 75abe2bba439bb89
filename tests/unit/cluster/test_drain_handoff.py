"""The drain hand-off's choices without Serve: which recent prefixes a stopped replica hands off
(the latest turn of each conversation, most recent first, within the bound) and when the
hand-off is on (a deployment behind `HybridPrefixRouter`, pulls on, `drain_handoff_prefixes` > 0).
"""

from __future__ import annotations

import pytest

from cluster.serve.drain_handoff import HandoffPrefix, RecentPrefixes, handoff_options
from cluster.serve.routing_options import RoutingOptions

ROUTER = "cluster.serve.routing:HybridPrefixRouter"


def turn(conversation: int, num_turns: int) -> HandoffPrefix:
    """The tokens of a conversation after `num_turns` turns of 8 tokens (its own first token)."""
    tokens = (conversation, *range(100, 100 + 8 * num_turns - 1))
    return HandoffPrefix(tokens, len(tokens) - 4, None)


def test_the_latest_turn_of_each_conversation_most_recent_first_within_the_bound() -> None:
    recent = RecentPrefixes()
    for num_turns in (1, 2, 3):
        for conversation in (1, 2, 3):
            recent.record(turn(conversation, num_turns))
    assert recent.latest(8, block_size=4) == [turn(3, 3), turn(2, 3), turn(1, 3)]
    assert recent.latest(2, block_size=4) == [turn(3, 3), turn(2, 3)]


def test_a_turn_recorded_again_is_the_most_recent() -> None:
    recent = RecentPrefixes(capacity=2)
    for entry in (turn(1, 1), turn(2, 1), turn(1, 1), turn(3, 1)):
        recent.record(entry)
    assert recent.latest(8, block_size=4) == [turn(3, 1), turn(1, 1)]


def deployment(**kwargs: object) -> dict[str, object]:
    return {
        "request_router_config": {"request_router_class": ROUTER, "request_router_kwargs": kwargs}
    }


def test_on_behind_the_hybrid_router_unless_turned_off() -> None:
    options = handoff_options(deployment(pull_threshold_tokens=32, drain_handoff_prefixes=5))
    assert options is not None
    assert (options.min_tokens, options.max_prefixes) == (32, 5)
    assert handoff_options(deployment()) is not None  # on by default
    assert handoff_options(deployment(drain_handoff_prefixes=0)) is None
    assert handoff_options(deployment(pull_threshold_tokens=None)) is None
    assert handoff_options({"num_replicas": 2}) is None  # Serve's default router: no KV events


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="drain_handoff_prefixes must be >= 0"):
        RoutingOptions(drain_handoff_prefixes=-1)

"""Where the router tells a replica to pull a prefix from: the replica predicted to hold the
longest prefix, when a request goes elsewhere (load, a replica out of routing) and that prefix
leads the receiver's own hit by the threshold."""

from __future__ import annotations

import pytest
import yaml

from cluster.serve.hybrid_policy import PullHint
from cluster.serve.hybrid_router import with_router_defaults
from cluster.serve.routing_options import RoutingOptions
from tests.helpers.readme import code_block
from tests.helpers.routing_cases import PROMPT, holding_the_prompt, window_of


def test_a_request_sent_away_from_its_prefix_names_the_holder() -> None:
    policy, keys = holding_the_prompt(in_flight=8, min_in_flight_bound=4)
    chosen = policy.choose(["a", "b", "c"], keys, 0.0)[0][0]
    assert chosen != "a"  # a is over the in-flight bound
    assert policy.pull_source(chosen, keys, 0.0, threshold=16) == PullHint("a", 40, 40)
    assert policy.pull_source(chosen, keys, 0.0, threshold=41) is None  # below: recompute


def test_no_hint_when_the_receiver_holds_the_prefix_itself() -> None:
    policy, keys = holding_the_prompt(in_flight=0)
    assert policy.choose(["a", "b", "c"], keys, 0.0)[0] == ["a"]
    assert policy.pull_source("a", keys, 0.0, threshold=0) is None
    policy.replay("b", window_of(keys.block_hashes[:4], keys.block_hashes[:4]))
    assert policy.pull_source("b", keys, 0.0, threshold=16) == PullHint("a", 40, 24)
    assert policy.pull_source("b", keys, 0.0, threshold=25) is None


def test_a_replica_out_of_routing_is_still_a_source() -> None:
    """A replica that takes no new requests (draining) still serves as the prefix's source."""
    policy, keys = holding_the_prompt(in_flight=0)
    assert policy.choose(["b", "c"], keys, 0.0)[0] != ["a"]
    assert policy.pull_source("b", keys, 0.0, threshold=8) == PullHint("a", 40, 40)
    assert policy.pull_source("b", None, 0.0, threshold=8) is None
    assert len(PROMPT) == 41


def test_a_replica_that_left_routing_is_a_source_until_drain_pull_s() -> None:
    """Scaled down (draining): a pull source, not a target, for `drain_pull_s` after it left;
    then forgotten. A replica whose actor died is forgotten at once."""
    policy, keys = holding_the_prompt(in_flight=0, drain_pull_s=30.0)
    assert policy.keep_routable(["b", "c"], now=100.0) == ["a"]  # asked once: alive?
    assert policy.keep_routable(["b", "c"], now=110.0) == []
    assert policy.choose(["b", "c"], keys, 100.0)[0] != ["a"]
    assert policy.pull_source("b", keys, 129.0, threshold=8) == PullHint("a", 40, 40)
    assert policy.pull_source("b", keys, 130.0, threshold=8) is None  # past drain_pull_s
    policy.keep_routable(["b", "c"], now=130.0)
    assert "a" not in policy.replicas
    policy, keys = holding_the_prompt(in_flight=0, drain_pull_s=30.0)
    policy.keep_routable(["b", "c"], now=100.0)
    policy.forget("a")
    assert policy.pull_source("b", keys, 100.0, threshold=8) is None


def test_the_readme_pull_config_is_valid_and_bad_values_name_their_key() -> None:
    block = yaml.safe_load(code_block("pull_threshold_tokens: 256", "yaml"))
    router = block["deployment_config"]["request_router_config"]
    kwargs = with_router_defaults(router, "tok")["request_router_kwargs"]
    assert RoutingOptions(**{k: v for k, v in kwargs.items() if k.startswith("pull")})
    with pytest.raises(ValueError, match="pull_threshold_tokens"):
        RoutingOptions(pull_threshold_tokens=0)
    with pytest.raises(ValueError, match="pull_timeout_s"):
        RoutingOptions(pull_timeout_s=0)
    with pytest.raises(ValueError, match="drain_pull_s"):
        RoutingOptions(drain_pull_s=-1)

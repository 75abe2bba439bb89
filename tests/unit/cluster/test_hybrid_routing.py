"""The hybrid routing policy on hand-made replica caches, and the router's Serve config."""

from __future__ import annotations

import pytest
import yaml

from cluster.config import LLMConfig
from cluster.engine.input_processor import InputProcessor
from cluster.openai_api.protocol import ChatCompletionRequest
from cluster.serve.hybrid_policy import HybridRoutingPolicy
from cluster.serve.hybrid_router import kv_events_enabled
from cluster.serve.routing import resolve_request_router
from cluster.serve.routing_options import RoutingOptions
from scheduler.kv_cache.events import KVEventBatch, KVEventWindow
from tests.helpers.readme import code_block
from tests.helpers.routing_cases import GROUPS, PROMPT, holding_the_prompt, make_policy, window_of

ROUTER = "cluster.serve.routing:HybridPrefixRouter"


def test_a_replica_that_lost_the_window_tail_is_not_a_hit() -> None:
    """Replica a holds every full-attention block but lost the window's last blocks; b holds
    both groups up to block 6: b serves 28 tokens, a only 16, and b is chosen."""
    policy = make_policy()
    keys = policy.prompt_keys(PROMPT, None)
    assert keys is not None
    hashes = keys.block_hashes
    policy.replay("a", window_of(hashes, hashes[:4]))
    policy.replay("b", window_of(hashes[:7], hashes[:7]))
    hits = {key: policy.predicted_hit(key, keys, 0.0) for key in "abc"}
    assert hits == {"a": 16, "b": 28, "c": 0}
    assert policy.choose(["a", "b", "c"], keys, 0.0)[0] == ["b"]


def test_sessions_stick_and_new_conversations_spread() -> None:
    policy = make_policy()
    first = policy.prompt_keys(PROMPT, None)
    chosen = policy.choose(["a", "b", "c"], first, 0.0)[0][0]
    policy.routed(chosen, first, 0.0)
    policy.completed(chosen)
    follow_up = policy.prompt_keys([*PROMPT, 7, 8, 9, 10, 11], None)
    assert policy.choose(["a", "b", "c"], follow_up, 1.0)[0] == [chosen]
    other = policy.prompt_keys([99, *PROMPT], None)
    assert policy.choose(["a", "b", "c"], other, 1.0)[0] != [chosen]


def test_the_load_bound_overrides_the_hit() -> None:
    policy, keys = holding_the_prompt(2, load_factor=1.0, min_in_flight_bound=1)
    ranks = policy.choose(["a", "b", "c"], keys, 0.0)
    assert ranks[0] != ["a"]
    assert ranks[1][-1] == "a"


def test_below_the_least_bound_a_conversation_stays_with_its_hit() -> None:
    """Four in flight against none elsewhere passes 2x the mean, but not the least bound: a
    batching replica serves five requests about as fast as one, so the hit decides."""
    policy, keys = holding_the_prompt(4, load_factor=2.0, min_in_flight_bound=5)
    assert policy.choose(["a", "b", "c"], keys, 0.0)[0] == ["a"]
    policy.routed("a", keys, 0.0)
    assert policy.choose(["a", "b", "c"], keys, 0.0)[0] != ["a"]


def test_the_least_bound_is_at_least_one() -> None:
    with pytest.raises(ValueError, match="min_in_flight_bound"):
        RoutingOptions(min_in_flight_bound=0)


def test_replicas_out_of_routing_are_forgotten_with_no_drain_pull() -> None:
    policy = make_policy(drain_pull_s=0.0)
    keys = policy.prompt_keys(PROMPT, None)
    assert keys is not None
    policy.replay("a", window_of(keys.block_hashes, keys.block_hashes))
    policy.keep_routable(["b", "c"], now=0.0)
    assert policy.replicas == ("b", "c")
    assert policy.predicted_hit("a", keys, 0.0) == 0


def test_token_ids_from_the_router_are_not_tokenized_again() -> None:
    """The replica's input processor takes the router's token IDs as the prompt: with no
    tokenizer at all, a chat request still becomes those tokens."""
    inputs = InputProcessor(None, vocab_size=100, max_model_len=64, model_path="m")
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    prompt, params = inputs.openai(chat, token_ids=[5, 6, 7])
    assert prompt.token_ids == [5, 6, 7]
    assert params.max_tokens == 61
    with pytest.raises(ValueError, match="tokenizer"):
        inputs.openai(chat)


def test_load_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        RoutingOptions(load_factor=0.9)


def test_serve_config_gets_the_router_defaults_and_events_turn_on() -> None:
    llm = LLMConfig.model_validate(
        {"model_loading_config": {"model_id": "m", "model_source": "/models/m"}}
    )
    resolved = resolve_request_router({"request_router_class": ROUTER}, llm)
    assert resolved is not None
    assert resolved["request_router_kwargs"] == {"tokenizer_source": "/models/m", "model_id": "m"}
    assert resolved["request_routing_stats_period_s"] == 0.5
    mine = {"request_router_class": ROUTER, "request_routing_stats_period_s": 2.0}
    assert resolve_request_router(mine, llm)["request_routing_stats_period_s"] == 2.0  # type: ignore[index]
    assert kv_events_enabled({"request_router_config": resolved})
    assert not kv_events_enabled({})
    with pytest.raises(ValueError, match="load_factr"):
        resolve_request_router({**mine, "request_router_kwargs": {"load_factr": 2}}, llm)
    with pytest.raises(ValueError, match="load_factor must be >= 1"):
        resolve_request_router({**mine, "request_router_kwargs": {"load_factor": 0.5}}, llm)
    other = {"request_router_class": "x.y:Z"}
    assert resolve_request_router(other, llm) == other


def test_prompts_routed_before_the_first_events_are_guessed_once_they_come() -> None:
    policy: HybridRoutingPolicy[str] = HybridRoutingPolicy()
    policy.replay("b", window_of([], [], first_seq=0))  # a knows nothing yet
    keys = policy.prompt_keys(PROMPT, None)
    policy.routed("a", keys, 0.0)
    assert policy.predicted_hit("a", keys, 1.0) == 0
    policy.replay("a", window_of([], [], first_seq=0))
    assert policy.predicted_hit("a", keys, 1.0) == 40
    assert policy.predicted_hit("a", keys, RoutingOptions.guess_ttl_s + 1) == 0


def test_a_conversation_stays_even_when_its_history_is_a_small_part_of_the_prompt() -> None:
    """The second turn repeats 40 % of its prompt (below `strong_fraction`) and its replica has
    had more recent work than the work bound allows: it stays, since it extends a prompt sent
    there; a prompt that shares the same prefix but extends no routed prompt is moved."""
    policy = make_policy()
    first = policy.prompt_keys(PROMPT, None)
    policy.routed("a", first, 0.0)
    for number in range(2):
        policy.routed("a", policy.prompt_keys([200 + number] * 60, None), 0.0)
    for _ in range(3):
        policy.completed("a")
    policy.replay("b", window_of([], [], first_seq=1))
    second_turn = policy.prompt_keys([*PROMPT, *range(100, 160)], None)
    assert policy.predicted_hit("a", second_turn, 1.0) == 40
    assert policy.choose(["a", "b", "c"], second_turn, 1.0)[0] == ["a"]
    stranger = policy.prompt_keys([*PROMPT[:36], *range(100, 165)], None)
    assert 0 < policy.predicted_hit("a", stranger, 1.0) < 0.5 * stranger.num_tokens
    assert policy.choose(["a", "b", "c"], stranger, 1.0)[0] != ["a"]


def test_the_readme_router_config_is_a_valid_deployment_config() -> None:
    block = yaml.safe_load(code_block("request_router_kwargs: {load_factor", "yaml"))
    llm = LLMConfig.model_validate(
        {"model_loading_config": {"model_id": "m"}, "deployment_config": block["deployment_config"]}
    )
    assert kv_events_enabled(llm.deployment_config)
    resolved = resolve_request_router(llm.deployment_config["request_router_config"], llm)
    assert resolved is not None
    assert resolved["request_router_kwargs"]["load_factor"] == 2.0


def test_a_tier_hit_counts_below_a_device_hit_and_above_none() -> None:
    """Replica a holds the prompt's first 7 blocks on its device, b the same in its offload tier
    only: b's hit counts half (tier_hit_weight 0.5); a is chosen over b, b over c."""
    policy = make_policy()
    keys = policy.prompt_keys(PROMPT, None)
    assert keys is not None
    hashes = keys.block_hashes[:7]
    policy.replay("a", window_of(hashes, hashes))
    tier = KVEventBatch(
        stored=((), ()), removed=((), ()), tier_stored=(tuple(hashes), tuple(hashes)),
        tier_removed=((), ()),
    )  # fmt: skip
    policy.replay("b", KVEventWindow(GROUPS, 1, (tier,)))
    hits = {key: policy.predicted_hit(key, keys, 0.0) for key in "abc"}
    assert hits == {"a": 28, "b": 14, "c": 0}
    assert policy.choose(["a", "b", "c"], keys, 0.0)[0] == ["a"]
    assert policy.choose(["b", "c"], keys, 0.0)[0] == ["b"]

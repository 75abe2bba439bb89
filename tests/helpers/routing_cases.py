"""Hand-made replica caches for the hybrid routing policy's unit tests: two groups (full
attention and a sliding window, block 4), a 41-token prompt, KV event windows that store given
block hashes, and policies over replicas "a", "b" and "c"."""

from __future__ import annotations

from cluster.serve.hybrid_policy import HybridRoutingPolicy, PromptKeys
from cluster.serve.routing_options import RoutingOptions
from scheduler.kv_cache.events import KVEventBatch, KVEventWindow
from scheduler.kv_cache.spec import KVCacheGroupSpec
from scheduler.kv_cache.spec_factory import make_spec

GROUPS = (
    KVCacheGroupSpec(("full",), make_spec("full_attention", 4)),
    KVCacheGroupSpec(("window",), make_spec("sliding_window", 4, 8)),
)
PROMPT = list(range(1, 42))


def window_of(
    stored_full: list[bytes], stored_window: list[bytes], first_seq: int = 1
) -> KVEventWindow:
    """One batch of stores (after the empty batch 0 every replica starts with)."""
    batch = KVEventBatch(stored=(tuple(stored_full), tuple(stored_window)), removed=((), ()))
    return KVEventWindow(GROUPS, first_seq, (batch,))


def make_policy(**options: float) -> HybridRoutingPolicy[str]:
    policy: HybridRoutingPolicy[str] = HybridRoutingPolicy(RoutingOptions(**options))
    for key in ("a", "b", "c"):
        policy.replay(key, window_of([], [], first_seq=0))
    return policy


def holding_the_prompt(
    in_flight: int, **options: float
) -> tuple[HybridRoutingPolicy[str], PromptKeys]:
    """A policy whose replica "a" caches `PROMPT` and has `in_flight` requests of it in flight."""
    policy = make_policy(**options)
    keys = policy.prompt_keys(PROMPT, None)
    policy.replay("a", window_of(keys.block_hashes, keys.block_hashes))
    for _ in range(in_flight):
        policy.routed("a", keys, 0.0)
    return policy, keys

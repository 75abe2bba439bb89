"""`HybridPrefixRouter`: a Ray Serve request router that knows each replica's hybrid KV cache.

    replica: engine step ─► KV event log ─► record_routing_stats() {kv_events, kv_cache_usage,
                                                                     lora_adapters}
    controller polls every request_routing_stats_period_s ─► routers get it with the replicas
    router (in the caller, e.g. the ingress): tokenize once ─► HybridRoutingPolicy.choose
        ─► the prompt's token IDs travel with the request (the replica does not tokenize again)
        ─► sent away from the replica caching its prefix: where to pull it from (`peer_pull`)

The decision itself is `cluster.serve.hybrid_policy` (Ray-free, driven by the benchmark too).
Replicas turn their events on when their deployment names this router (`kv_events_enabled`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from cluster.config.lora import served_model
from cluster.engine.core import EngineCore
from cluster.engine.input_processor import InputProcessor
from cluster.engine.tokenizer import load_tokenizer
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.serve.hybrid_policy import HybridRoutingPolicy, PromptKeys
from cluster.serve.peer_pull import (
    KV_SOURCE_KWARG,
    TO_REPLICA_KWARG,
    PeerPull,
    replica_is_alive,
)
from cluster.serve.routing_options import RoutingOptions
from scheduler.kv_cache.events import KVEventWindow
from scheduler.lora import prefix_salt

logger = logging.getLogger(__name__)

ROUTER_NAMES = frozenset(
    {"cluster.serve.routing:HybridPrefixRouter", "cluster.serve.routing.HybridPrefixRouter"}
)
KV_EVENTS_STAT = "kv_events"
KV_USAGE_STAT = "kv_cache_usage"
LORA_ADAPTERS_STAT = "lora_adapters"
PROMPT_TOKEN_IDS_KWARG = "prompt_token_ids"
"""The keyword under which the router hands the replica the prompt it tokenized."""
DEFAULT_STATS_PERIOD_S = 0.5
MAX_TRACKED_REQUESTS = 1 << 14
"""Prompts kept between choosing a replica and hearing the request was routed there."""
_NO_LIMIT = 1 << 62
LIVENESS_CHECK_S = 1.0
"""How often the router asks whether a replica that left routing (draining) still lives."""


def kv_events_enabled(deployment_config: Mapping[str, Any]) -> bool:
    """Whether a model deployment is routed by `HybridPrefixRouter` (its replicas then keep
    KV events; off otherwise, e.g. for a single replica behind Serve's default router)."""
    router = deployment_config.get("request_router_config") or {}
    return router.get("request_router_class") in ROUTER_NAMES


_MODEL_KWARGS = ("tokenizer_source", "model_id")
"""Router kwargs that describe the model rather than the routing options."""


def with_router_defaults(
    config: dict[str, Any], tokenizer_source: str, model_id: str = ""
) -> dict[str, Any]:
    """`request_router_config` of our router with a short stats period and the model's
    tokenizer and served name filled in where the user set neither."""
    kwargs = {
        "tokenizer_source": tokenizer_source,
        "model_id": model_id,
        **(config.get("request_router_kwargs") or {}),
    }
    options = {key: value for key, value in kwargs.items() if key not in _MODEL_KWARGS}
    try:
        RoutingOptions(**options)
    except TypeError:
        known = ", ".join([*_MODEL_KWARGS, *RoutingOptions.__dataclass_fields__])
        raise ValueError(
            f"request_router_kwargs of HybridPrefixRouter: unknown key among {sorted(options)}; "
            f"known: {known}"
        ) from None
    return {
        "request_routing_stats_period_s": DEFAULT_STATS_PERIOD_S,
        **config,
        "request_router_kwargs": kwargs,
    }


def routing_stats(core: EngineCore) -> dict[str, Any]:
    """What a replica tells the routers: its recent KV events, KV usage and loaded LoRA
    adapters ({} when off)."""
    if core.kv_events is None:
        return {}
    usage = core.scheduler.kv_cache_manager.usage
    adapters = tuple(sorted(core.loras))
    return {
        KV_EVENTS_STAT: core.kv_events.window(),
        KV_USAGE_STAT: usage,
        LORA_ADAPTERS_STAT: adapters,
    }


@dataclass(frozen=True)
class RoutingChoice:
    """A request's routing as the router decided it (its latest, for logs and tests)."""

    replica: ReplicaID
    """The replica ranked first."""
    in_flight: Mapping[ReplicaID, int]
    """Each candidate's requests in flight as the choice saw them."""
    pull: PeerPull | None
    """Where the chosen replica is told to pull the prompt's prefix from (None: nowhere)."""


class HybridPrefixRouter(FIFOMixin, RequestRouter):
    """Routes each request to the replica predicted to serve the longest prefix from its
    hybrid cache (valid for every KV cache group), within a load bound."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`request_router_kwargs`: `tokenizer_source` (the builder sets the model's), and the
        `RoutingOptions` fields (`load_factor`, `min_in_flight_bound`, `match_fraction`,
        `work_half_life_s`, `guess_ttl_s`, `pull_threshold_tokens`, `pull_timeout_s`,
        `drain_pull_s`, ...)."""
        tokenizer_source = kwargs.pop("tokenizer_source", None)
        self._model_id: str = kwargs.pop("model_id", "") or ""
        self.policy: HybridRoutingPolicy[ReplicaID] = HybridRoutingPolicy(RoutingOptions(**kwargs))
        self._tokenizer_source = tokenizer_source
        self._inputs: InputProcessor | None = None
        self._prompts: dict[str, PromptKeys | None] = {}
        self.last_choice: RoutingChoice | None = None
        """The latest request's routing (None before the first)."""
        self._draining: dict[ReplicaID, float] = {}
        """Replicas that left routing, kept as pull sources: when each was last seen alive."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        now = time.monotonic()
        for replica in replicas:
            stats = replica.routing_stats or {}
            window = stats.get(KV_EVENTS_STAT)
            if isinstance(window, KVEventWindow):
                usage = float(stats.get(KV_USAGE_STAT, 0.0))
                adapters = stats.get(LORA_ADAPTERS_STAT)
                self.policy.replay(replica.replica_id, window, usage, adapters, now)
        routable = [replica.replica_id for replica in replicas]
        for replica_id in self.policy.keep_routable(routable, now):
            self._draining[replica_id] = now - LIVENESS_CHECK_S
        self._forget_the_dead(set(routable), now)

    def _forget_the_dead(self, routable: set[ReplicaID], now: float) -> None:
        """Forget each replica that left routing once its actor is gone (it died, or its drain
        ended: its conversations' prefixes are then cached by the peers it handed them to)."""
        for replica_id, seen_at in list(self._draining.items()):
            if replica_id in routable:
                del self._draining[replica_id]
            elif now - seen_at >= LIVENESS_CHECK_S:
                if replica_is_alive(replica_id):
                    self._draining[replica_id] = now
                else:
                    del self._draining[replica_id]
                    self.policy.forget(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None and TO_REPLICA_KWARG in pending_request.kwargs:
            source = pending_request.kwargs[TO_REPLICA_KWARG]  # pinned: a replica's own stats
            return [[r for r in candidate_replicas if r.replica_id.unique_id == source]]
        prompt = self._prompt_keys(pending_request)
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        now = time.monotonic()
        ranks = self.policy.choose(list(by_id), prompt, now)
        if pending_request is not None and ranks and ranks[0]:
            chosen = ranks[0][0]
            pull = self._hint_pull(pending_request, chosen, prompt, now)
            in_flight = {key: self.policy.in_flight(key) for key in by_id}
            self.last_choice = RoutingChoice(chosen, in_flight, pull)
            logger.debug("routing: %s (in flight %s, pull %s)", chosen, in_flight, pull)
        return [[by_id[key] for key in rank] for rank in ranks if rank]

    def _hint_pull(
        self,
        pending_request: PendingRequest,
        chosen: ReplicaID,
        prompt: PromptKeys | None,
        now: float,
    ) -> PeerPull | None:
        """Tell the chosen replica where the prompt's prefix is cached when it should pull it
        (the hint given, or None)."""
        options = self.policy.options
        if options.pull_threshold_tokens is None:
            return None
        hint = self.policy.pull_source(chosen, prompt, now, options.pull_threshold_tokens)
        if hint is None:
            pending_request.kwargs.pop(KV_SOURCE_KWARG, None)
            return None
        source = hint.source.unique_id
        pull = PeerPull(source, hint.num_tokens, options.pull_timeout_s)
        pending_request.kwargs[KV_SOURCE_KWARG] = pull
        return pull

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        prompt = self._prompts.pop(pending_request.metadata.internal_request_id, None)
        self.policy.routed(replica_id, prompt, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._prompts.pop(internal_request_id, None)
        self.policy.completed(replica_id)

    def _prompt_keys(self, pending_request: PendingRequest | None) -> PromptKeys | None:
        """The request's block hashes (tokenized once: a retry reuses them)."""
        if pending_request is None:
            return None
        request_id = pending_request.metadata.internal_request_id
        if request_id in self._prompts:
            return self._prompts[request_id]
        keys = None
        token_ids = self._token_ids(pending_request)
        if token_ids:
            request = pending_request.args[0]
            adapter = self._adapter(request)
            salt = prefix_salt(getattr(request, "cache_salt", None), adapter)
            keys = self.policy.prompt_keys(token_ids, salt, adapter)
        if len(self._prompts) >= MAX_TRACKED_REQUESTS:  # requests that were never routed
            del self._prompts[next(iter(self._prompts))]
        self._prompts[request_id] = keys
        return keys

    def _adapter(self, request: Any) -> str | None:
        """The LoRA adapter the request names (`model="<model_id>:<adapter>"`): part of the
        block-0 key the replicas hash with (hits are predicted per adapter), and drawn to the
        replicas that have it loaded."""
        model = getattr(request, "model", None)
        served = served_model(model, [self._model_id]) if model and self._model_id else None
        return served[1] if served is not None else None

    def _token_ids(self, pending_request: PendingRequest) -> list[int] | None:
        """The prompt's token IDs, handed on to the replica; None when the request is not an
        OpenAI request or does not tokenize (the replica then answers its error)."""
        given = pending_request.kwargs.get(PROMPT_TOKEN_IDS_KWARG)
        if given is not None:
            return list(given)
        request = pending_request.args[0] if pending_request.args else None
        inputs = self._input_processor()
        try:
            if isinstance(request, ChatCompletionRequest):
                generation = request.add_generation_prompt
                prompt = inputs.chat(request.messages, request.chat_template, generation)
            elif isinstance(request, CompletionRequest):
                prompt = inputs.prompt(request.prompts[0])  # a batch is routed by its first
            else:
                return None
        except (ValueError, TypeError):
            return None
        is_single = not isinstance(request, CompletionRequest) or len(request.prompts) == 1
        if prompt.text is not None and is_single:  # the replica need not tokenize it again
            pending_request.kwargs[PROMPT_TOKEN_IDS_KWARG] = prompt.token_ids
        return prompt.token_ids

    def _input_processor(self) -> InputProcessor:
        if self._inputs is None:
            source = self._tokenizer_source or ""
            tokenizer = load_tokenizer(source) if source else None
            self._inputs = InputProcessor(tokenizer, _NO_LIMIT, _NO_LIMIT, source)
        return self._inputs

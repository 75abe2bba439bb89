"""Request routers for the model deployments.

`HybridPrefixRouter` (`cluster.serve.routing:HybridPrefixRouter`) routes by the hit each
replica's hybrid KV cache would give (see `cluster.serve.hybrid_router`).

Ray's prefix-cache affinity router, named as users name it
(`ray.serve.llm.request_router.PrefixCacheAffinityRouter`), is replaced by the subclass here:

- Ray's public module imports vLLM or SGLang protocol models on import, so without either
  installed the name fails to load; the router itself needs neither;
- Ray's router divides by the prompt's text length and reads no token IDs, so an empty prompt
  (or a prompt of token IDs) made it fail on every retry and the request hang; here token IDs
  are routed by their decimal text and an empty prompt by a single space (it still gets its 400
  from the model server);
- in the one-hop topology the proxy hands the model deployment raw HTTP requests, whose prompt
  no router can read before the body is parsed: those are routed as an empty prompt (by load).
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter as _PrefixCacheAffinityRouter,
)

from cluster.config import LLMConfig
from cluster.config.llm_config import resolve_source
from cluster.serve.hybrid_router import HybridPrefixRouter, kv_events_enabled, with_router_defaults

__all__ = ["HybridPrefixRouter", "PrefixCacheAffinityRouter", "resolve_request_router"]

_PUBLIC_NAMES = {
    "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
    "PrefixCacheAffinityRouter",
}
OURS = f"{__name__}.PrefixCacheAffinityRouter"


def _token_text(args: Any) -> str:
    """Token-ID prompts as text the prefix tree can match ("12 7 99 ...")."""
    for arg in args or ():
        prompt = getattr(arg, "prompt", None)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return " ".join(str(t) for t in prompt)
    return ""


class PrefixCacheAffinityRouter(_PrefixCacheAffinityRouter):
    """Ray Serve LLM's prefix-cache affinity router, safe for empty and token-ID prompts."""

    def _extract_text_from_request(self, pending_request: Any) -> str:
        try:
            text: str = super()._extract_text_from_request(pending_request)
        except ValueError:  # an HTTP request from the proxy (one-hop topology): no prompt yet
            text = ""
        return text or _token_text(pending_request.args) or " "


def resolve_request_router(
    config: dict[str, Any] | None, llm_config: LLMConfig | None = None
) -> dict[str, Any] | None:
    """`request_router_config` with Ray's prefix-cache affinity router swapped for ours, and
    `HybridPrefixRouter`'s defaults (stats period, the model's tokenizer) filled in."""
    if config and kv_events_enabled({"request_router_config": config}):
        loading = llm_config.model_loading_config if llm_config is not None else None
        source = (loading.tokenizer_source or loading.source) if loading is not None else ""
        model_id = llm_config.model_id if llm_config is not None else ""
        return with_router_defaults(config, resolve_source(source) if source else "", model_id)
    if not config or config.get("request_router_class") not in _PUBLIC_NAMES:
        return config
    return {**config, "request_router_class": OURS}

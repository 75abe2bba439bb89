"""Request routers for the model deployments.

Ray's public `ray.serve.llm.request_router` module imports vLLM or SGLang protocol models on
import, so without either installed the name a user writes in `request_router_config` fails to
load. The router itself needs neither: `PrefixCacheAffinityRouter` here is the same router class,
and `resolve_request_router` swaps the public name for this one when the public import fails.
"""

from __future__ import annotations

import importlib
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter as _PrefixCacheAffinityRouter,
)

_PUBLIC_MODULE = "ray.serve.llm.request_router"
_OURS = {"PrefixCacheAffinityRouter": f"{__name__}.PrefixCacheAffinityRouter"}


class PrefixCacheAffinityRouter(_PrefixCacheAffinityRouter):
    """Ray Serve LLM's prefix-cache affinity router (routes by prompt/messages prefix)."""


def resolve_request_router(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`request_router_config` with Ray's LLM router names made importable here."""
    if not config or not isinstance(config.get("request_router_class"), str):
        return config
    path = config["request_router_class"]
    module, _, name = path.rpartition(".")
    if module != _PUBLIC_MODULE or name not in _OURS:
        return config
    try:
        importlib.import_module(_PUBLIC_MODULE)
    except ImportError:
        return {**config, "request_router_class": _OURS[name]}
    return config

"""The environment variables hybridserve reads, read here and nowhere else.

The Helm chart sets them from Secrets: `HF_TOKEN` (read by huggingface_hub itself) and
`HYBRIDSERVE_API_KEY`, the key clients must send as `Authorization: Bearer ...`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_ENV = "HYBRIDSERVE_API_KEY"
"""Name of the variable holding the serving API key."""


def api_key_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The API key clients must present, or None when serving without one."""
    value = (os.environ if environ is None else environ).get(API_KEY_ENV, "").strip()
    return value or None


RAY_ADDRESS_ENV = "RAY_ADDRESS"
"""Ray's own variable naming the cluster to join (`auto`, `local`, `host:port`, `ray://...`)."""


def ray_address_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The cluster address RAY_ADDRESS names, or None when it is unset or empty."""
    value = (os.environ if environ is None else environ).get(RAY_ADDRESS_ENV, "").strip()
    return value or None


SERVER_DEV_MODE_ENV = "HYBRIDSERVE_SERVER_DEV_MODE"
"""Set to 1 (or true) to serve the development routes (`/sleep`, `/wake_up`, `/pause`,
`/collective_rpc`, ...), as vLLM's `VLLM_SERVER_DEV_MODE`: they let any client stop the engine
or run code on its workers, so never in production."""


def server_dev_mode_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the development routes are served (`SERVER_DEV_MODE_ENV`)."""
    value = (os.environ if environ is None else environ).get(SERVER_DEV_MODE_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


BATCH_INVARIANT_ENVS = ("HYBRIDSERVE_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")
"""Set either to 1 (or true) to run engines in the batch-invariant mode, as the engine argument
`batch_invariant=True` does (vLLM's variable is honoured too)."""


def batch_invariant_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a variable of `BATCH_INVARIANT_ENVS` turns the batch-invariant mode on."""
    values = os.environ if environ is None else environ
    return any(
        values.get(name, "").strip().lower() in ("1", "true", "yes", "on")
        for name in BATCH_INVARIANT_ENVS
    )

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

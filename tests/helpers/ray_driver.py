"""This test process as the driver of a Ray cluster started with token authentication.

Ray reads `RAY_AUTH_MODE` and the token once per process and caches both; a test process that
already used Ray (with other settings) must make it read them again before it connects, and
again after it disconnects, so later tests see their own settings.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from tests.helpers.ray_nodes import HEAD_IP, RayNodes

_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")


def _reload_ray_auth() -> None:
    """Make this process's Ray read RAY_AUTH_MODE and the token again (it caches both)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def driver(cluster: RayNodes) -> Iterator[None]:
    """This process as a driver of `cluster` (with its token), disconnected on exit."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    saved = {name: os.environ.pop(name, None) for name in _AUTH_VARS}
    os.environ.update({name: cluster.env[name] for name in _AUTH_VARS if name in cluster.env})
    _reload_ray_auth()
    try:
        ray.init(address=cluster.address, _node_ip_address=HEAD_IP, log_to_driver=False)
        yield
    finally:
        ray.shutdown()
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
        _reload_ray_auth()

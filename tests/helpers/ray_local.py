"""One local Ray instance per test session, on loopback only, sized for a 2-core machine.

Ray maps 127.0.0.1 to the machine's interface address, so the node is pinned to 127.0.0.2;
`address="local"` always starts a new instance (never joins a stale one). Workers get the
repository on PYTHONPATH, so they import the code under test.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_IP = "127.0.0.2"


def start_local_ray(num_cpus: int = 8) -> None:
    """Start the session's Ray instance unless it is already running (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",
        _node_ip_address=NODE_IP,
        num_cpus=num_cpus,
        object_store_memory=256 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}},
    )


def stop_local_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()

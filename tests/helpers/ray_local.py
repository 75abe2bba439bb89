"""One local Ray instance at a time for the tests, on loopback only, declaring the CPUs the
machine has (a test module that needs more logical CPUs says why in `RAY_CPUS`).

Ray maps 127.0.0.1 to the machine's interface address, so the node is pinned to 127.0.0.2;
`address="local"` always starts a new instance (never joins a stale one). Workers get the
repository on PYTHONPATH, so they import the code under test.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE_IP = "127.0.0.2"


_declared_cpus: int | None = None
"""The CPUs the running instance declares (None: none started here)."""


def machine_cpus() -> int:
    """The CPUs this process may run on (the affinity mask, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def start_local_ray(num_cpus: int | None = None) -> None:
    """Have a local Ray instance declaring `num_cpus` (default: the machine's CPUs) running:
    start one, keep the running one if it declares as many, else restart it."""
    import ray

    global _declared_cpus
    wanted = num_cpus if num_cpus is not None else machine_cpus()
    if ray.is_initialized():
        if wanted == _declared_cpus:
            return
        ray.shutdown()
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",
        _node_ip_address=NODE_IP,
        num_cpus=wanted,
        object_store_memory=256 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}},
    )
    _declared_cpus = wanted


def stop_local_ray() -> None:
    import ray

    global _declared_cpus
    if ray.is_initialized():
        ray.shutdown()
    _declared_cpus = None

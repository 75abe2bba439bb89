"""CPU seconds per process role while a benchmark level runs: where a served token's cost goes.

Roles come from the process titles Ray gives its workers (`ray::ServeReplica:<app>:<deployment>`,
`ray::ProxyActor`, `ray::HAProxyManager`, the rank actors, ...) and the `haproxy` binary, so a
level's CPU can be split between the load generator, Serve's proxy or HAProxy, each
application's replicas, the model ranks and Ray's own daemons.
"""

from __future__ import annotations

import os

import psutil

CpuSnapshot = dict[int, tuple[str, float]]


def _role(process: psutil.Process) -> str:
    if process.pid == os.getpid():
        return "load generator (this process)"
    title = " ".join(process.cmdline()) or process.name()
    if title.startswith("ray::ServeReplica:"):
        return "replica " + title.split(":")[3].split()[0]  # ray::ServeReplica:app:deployment
    if title.startswith("ray::") and "ProxyActor" in title:  # also `SERVE_PROXY_ACTOR-...`
        return "ProxyActor"
    if title.startswith("ray::"):
        return title[len("ray::") :].split()[0].split(".")[0]
    for daemon in ("haproxy", "raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env"):
        if daemon in title:
            return daemon
    return "other"


def snapshot() -> CpuSnapshot:
    """This process and its descendants (the local Ray instance it started, and everything
    that instance runs; not other programs of the machine's user): role and CPU seconds so far."""
    found: CpuSnapshot = {}
    this = psutil.Process()
    for process in [this, *this.children(recursive=True)]:
        try:
            times = process.cpu_times()
            found[process.pid] = (_role(process), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def cpu_by_role(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, float]:
    """CPU seconds per role between two snapshots (processes born in between count in full)."""
    spent: dict[str, float] = {}
    for pid, (role, seconds) in after.items():
        start = before.get(pid, (role, 0.0))[1]
        spent[role] = spent.get(role, 0.0) + max(0.0, seconds - start)
    ordered = sorted(spent.items(), key=lambda item: -item[1])
    return {role: round(seconds, 3) for role, seconds in ordered if seconds >= 0.01}

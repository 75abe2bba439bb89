"""What a test left behind on the local Ray instance: named hybridserve actors, placement groups."""

from __future__ import annotations


def live_engine_actors() -> set[str]:
    """Names of the live engine and worker actors (every one is named `hybridserve-…`)."""
    import ray

    names = (a["name"] for a in ray.util.list_named_actors(all_namespaces=True))
    return {name for name in names if name.startswith("hybridserve-")}


def live_placement_groups() -> set[str]:
    """IDs of the placement groups not removed."""
    import ray

    table = ray.util.placement_group_table()
    return {pg_id for pg_id, pg in table.items() if pg["state"] != "REMOVED"}


def settled_engine_actors(expected: set[str], timeout_s: float = 10.0) -> set[str]:
    """The live engine and worker actors once they are `expected`, else as they are after
    `timeout_s`: a killed actor leaves Ray's table only once its process is gone, later on a
    loaded machine."""
    import time

    deadline = time.monotonic() + timeout_s
    live = live_engine_actors()
    while live != expected and time.monotonic() < deadline:
        time.sleep(0.1)
        live = live_engine_actors()
    return live

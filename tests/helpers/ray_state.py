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

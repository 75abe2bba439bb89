"""The order batch lines go to the engines in: prefix groups, leaders first, a bounded window."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.openai_api.batch_protocol import BatchLine
from cluster.serve.batch_dispatch import PREFIX_GROUP_CHARS, dispatch, prefix_groups

SHARED = "t1 " * PREFIX_GROUP_CHARS


def _line(index: int, prompt: str) -> BatchLine:
    return BatchLine(index, f"r{index}", "/v1/completions", {"prompt": prompt})


def _interleaved() -> list[BatchLine]:
    """Three groups of four lines sharing long prefixes, interleaved in input order."""
    return [_line(i, f"{'abc'[i % 3] * 4} {SHARED} q{i}") for i in range(12)]


def test_lines_sharing_a_long_prefix_form_one_group() -> None:
    groups = prefix_groups(_interleaved())
    assert len(groups) == 3
    for group in groups:
        members = [group.leader, *group.followers]
        assert len({line.index % 3 for line in members}) == 1
        assert len(members) == 4


def test_followers_start_after_their_leader_and_groups_run_together() -> None:
    started: list[int] = []
    finished: list[int] = []
    in_flight = 0
    most = 0

    async def send(line: BatchLine) -> dict[str, Any]:
        nonlocal in_flight, most
        started.append(line.index)
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.001)
        in_flight -= 1
        return {"custom_id": line.custom_id}

    def done(line: BatchLine, result: dict[str, Any]) -> None:
        finished.append(line.index)

    asyncio.run(dispatch(_interleaved(), send, done, window=4))
    assert sorted(finished) == list(range(12))
    assert most <= 4
    for group in prefix_groups(_interleaved()):
        leader_done = finished.index(group.leader.index)
        assert all(
            started.index(f.index) > started.index(group.leader.index) for f in group.followers
        )
        assert all(finished.index(f.index) > leader_done for f in group.followers)


def test_input_order_runs_each_line_once_in_order() -> None:
    started: list[int] = []

    async def send(line: BatchLine) -> dict[str, Any]:
        started.append(line.index)
        return {}

    asyncio.run(dispatch(_interleaved(), send, lambda line, result: None, window=1, order="input"))
    assert started == list(range(12))

"""The order and pace in which a batch's lines go to the engines (plain asyncio, no Ray).

Lines sharing a prefix run together so the prefix cache serves them: the lines are sorted by
their prompt text (a chat's messages as they are written, a completion's prompt), and adjacent
lines whose prompts share at least `PREFIX_GROUP_CHARS` characters form a group. A group's first
line (its leader) runs first; the others wait until it has finished, when its prefix is cached,
then run together. Meanwhile the other groups' leaders run. In input order the same lines
compute each shared prefix again wherever the cache no longer holds it.

At most `window` lines are in flight, so the engines' waiting queues stay short and an
interactive request is never queued behind a whole batch. Results are handed back as each line
finishes (`on_done`); the caller writes the output in input order.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from cluster.openai_api.batch_protocol import BatchLine

PREFIX_GROUP_CHARS = 64
"""Shared prompt characters that put two adjacent (sorted) lines in one group: about a KV block
of text or more."""
Order = Literal["prefix", "input"]
Send = Callable[[BatchLine], Awaitable[dict[str, Any]]]
OnDone = Callable[[BatchLine, dict[str, Any]], None]


def prompt_text(line: BatchLine) -> str:
    """The text a line's prompt starts with, for sorting (chat: the messages as JSON)."""
    body = line.body or {}
    if "messages" in body:
        return json.dumps(body["messages"], sort_keys=True, ensure_ascii=False)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _shared_chars(first: str, second: str) -> int:
    """Characters the two strings share from their start."""
    for position, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return position
    return min(len(first), len(second))


@dataclass(frozen=True)
class Group:
    """Lines sharing a prefix: the leader runs first, the followers after it."""

    leader: BatchLine
    followers: tuple[BatchLine, ...]


def prefix_groups(lines: Sequence[BatchLine]) -> list[Group]:
    """The lines sorted by prompt and cut into groups of shared prefixes (in sorted order)."""
    keyed = sorted(((prompt_text(line), line.index, line) for line in lines), key=lambda k: k[:2])
    groups: list[list[BatchLine]] = []
    previous = None
    for text, _, line in keyed:
        if previous is not None and _shared_chars(previous, text) >= PREFIX_GROUP_CHARS:
            groups[-1].append(line)
        else:
            groups.append([line])
        previous = text
    return [Group(group[0], tuple(group[1:])) for group in groups]


def input_groups(lines: Sequence[BatchLine]) -> list[Group]:
    """Each line alone, in input order (the baseline the prefix order is measured against)."""
    return [Group(line, ()) for line in lines]


def active_group_limit(groups: Sequence[Group], window: int) -> int:
    """How many groups may have lines in flight or waiting at once: enough to fill the window
    with their lines (and one more, whose leader computes the next prefix meanwhile)."""
    if not groups:
        return 1
    mean_size = sum(1 + len(group.followers) for group in groups) / len(groups)
    return max(1, math.ceil(window / mean_size)) + 1


async def dispatch(
    lines: Sequence[BatchLine],
    send: Send,
    on_done: OnDone,
    window: int,
    order: Order = "prefix",
) -> None:
    """Run every line through `send`, at most `window` at once, in `order`; `on_done` gets each
    result as it comes. A group's waiting followers go before any new group's leader, and at
    most `active_group_limit` groups are under way, so a prefix is reused while it is cached.
    Cancelling this coroutine cancels the lines in flight (their results are not reported)."""
    if window < 1:
        raise ValueError(f"the window must be >= 1, got {window}")
    groups = prefix_groups(lines) if order == "prefix" else input_groups(lines)
    limit = active_group_limit(groups, window)
    group_of = {line.index: group for group in groups for line in (group.leader, *group.followers)}
    left = {group.leader.index: 1 + len(group.followers) for group in groups}
    not_started = deque(groups)
    ready: deque[BatchLine] = deque()
    in_flight: dict[asyncio.Future[dict[str, Any]], BatchLine] = {}
    active = 0
    try:
        while not_started or ready or in_flight:
            while len(in_flight) < window and (ready or (not_started and active < limit)):
                if ready:
                    line = ready.popleft()
                else:
                    line = not_started.popleft().leader
                    active += 1
                in_flight[asyncio.ensure_future(send(line))] = line
            finished, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                line = in_flight.pop(task)
                on_done(line, task.result())
                group = group_of[line.index]
                if line is group.leader:
                    ready.extend(group.followers)
                left[group.leader.index] -= 1
                if left[group.leader.index] == 0:
                    active -= 1
    finally:
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)

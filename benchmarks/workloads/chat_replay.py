"""Replaying chats through the replay tool's manager: the answers of one turn decoded together."""

from __future__ import annotations

from scheduler.replay import TraceReplayer


def decode_interleaved(replayer: TraceReplayer, turn: int, answers: list[list[int]]) -> None:
    """One token of every unfinished answer per step (request `c<index>t<turn>`), as a batch
    decodes them."""
    for step in range(max(map(len, answers))):
        replayer.run(
            [
                {"op": "decode", "id": f"c{index}t{turn}", "tokens": [answer[step]]}
                for index, answer in enumerate(answers)
                if step < len(answer)
            ]
        )

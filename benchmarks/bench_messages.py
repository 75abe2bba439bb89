"""Cost of building and pickling the per-step messages, for the ways a frozen message can be made.

`CachedRequestData` (one per running request per step) and `RequestStepOutput` (one per request
per step) used to fill their instance dict in one call instead of the frozen dataclass
constructor; they are frozen `msgspec.Struct`s now. This measures the former way against a plain
frozen dataclass, a slotted frozen dataclass and the Struct, in the same run: construction of
256 messages, and a pickle round trip of a list of them (what crosses a process or Ray hop).

    .venv/bin/python benchmarks/bench_messages.py [--repeats 2000]
"""

from __future__ import annotations

import argparse
import pickle
import timeit
from dataclasses import dataclass

from scheduler.output import CachedRequestData


@dataclass(frozen=True, init=False)
class DictFill:
    """The former hot-path message: frozen, its instance dict filled in one call."""

    req_id: str
    num_computed_tokens: int
    new_token_ids: list[int]
    new_block_ids: tuple[list[int], ...] | None
    is_resumed: bool = False

    def __init__(
        self,
        req_id: str,
        num_computed_tokens: int,
        new_token_ids: list[int],
        new_block_ids: tuple[list[int], ...] | None,
        is_resumed: bool = False,
    ) -> None:
        self.__dict__.update(
            req_id=req_id,
            num_computed_tokens=num_computed_tokens,
            new_token_ids=new_token_ids,
            new_block_ids=new_block_ids,
            is_resumed=is_resumed,
        )


@dataclass(frozen=True)
class PlainFrozen:
    req_id: str
    num_computed_tokens: int
    new_token_ids: list[int]
    new_block_ids: tuple[list[int], ...] | None
    is_resumed: bool = False


@dataclass(frozen=True, slots=True)
class SlottedFrozen:
    req_id: str
    num_computed_tokens: int
    new_token_ids: list[int]
    new_block_ids: tuple[list[int], ...] | None
    is_resumed: bool = False


CANDIDATES = {
    "dict fill (before)": DictFill,
    "frozen dataclass": PlainFrozen,
    "frozen dataclass, slots": SlottedFrozen,
    "msgspec.Struct(frozen) (CachedRequestData today)": CachedRequestData,
}
NUM_MESSAGES = 256


def build(cls: type) -> list[object]:
    return [cls(f"req-{i}", 500 + i, [i], ([i + 1], [i + 2])) for i in range(NUM_MESSAGES)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    rows = []
    for name, cls in CANDIDATES.items():
        build_s = min(timeit.repeat(lambda c=cls: build(c), number=args.repeats // 10, repeat=5))
        messages = build(cls)
        trip_s = min(
            timeit.repeat(
                lambda m=messages: pickle.loads(pickle.dumps(m)),
                number=args.repeats // 10,
                repeat=5,
            )
        )
        rows.append((name, build_s, trip_s))
    base_build, base_trip = rows[0][1], rows[0][2]
    scale = 1e6 / (args.repeats // 10)
    print(f"| message kind | build {NUM_MESSAGES} µs | ratio | pickle round trip µs | ratio |")
    print("|---|---|---|---|---|")
    for name, build_s, trip_s in rows:
        print(
            f"| {name} | {build_s * scale:.1f} | {build_s / base_build:.2f}x | "
            f"{trip_s * scale:.1f} | {trip_s / base_trip:.2f}x |"
        )


if __name__ == "__main__":
    main()

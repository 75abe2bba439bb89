"""Which phases of an allocation a step of a request holding tables needs: freeing its
out-of-window blocks, growing its tables, registering its full blocks. The manager keeps per
request the quiet limits (`SingleTypeManager.quiet_limits`, minimum over groups) under which
each phase changes nothing, and runs only the phases a step crosses; a step that crosses none
(a decode between block boundaries) allocates nothing at all."""

from __future__ import annotations

from typing import NamedTuple


class StepPhases(NamedTuple):
    """The allocation phases a step runs."""

    frees: bool
    """Some group frees blocks no future query reads (computed reached the next drop)."""
    grows: bool
    """Some group's table lacks slots for the step's tokens (plus lookahead)."""
    caches: bool
    """Some group has a newly full block to register (known tokens reached it)."""


ALL_PHASES = StepPhases(True, True, True)
"""A new request, or one whose limits do not apply: every phase runs."""


def step_phases(
    limits: tuple[int, int, int],
    num_computed: int,
    num_new_tokens: int,
    num_slots_ahead: int,
    num_known_tokens: int,
) -> StepPhases:
    """Phases of a step computing `num_new_tokens` after `num_computed`, with
    `num_slots_ahead` slots past them (lookahead and the drafter's), `num_known_tokens` the
    request's tokens so far; `limits` are the request's (slots, computed, cached) limits."""
    main_tokens = num_computed + num_new_tokens
    return StepPhases(
        frees=num_computed >= limits[1],
        grows=main_tokens + num_slots_ahead > limits[0],
        caches=min(main_tokens, num_known_tokens) >= limits[2],
    )

"""The acceptance-aware switch: a request whose drafts keep being rejected stops verifying them
(and gives back its draft-state slots), re-probes after a back-off that doubles while probes
fail, and drafts again from the first good probe on."""

from __future__ import annotations

from typing import Any

import pytest
from kv_cache_helpers import full, make_config, mamba

from scheduler.config import SchedulerConfig
from scheduler.kv_cache.spec import MambaCacheMode
from scheduler.output import ModelRunnerOutput
from scheduler.request import Request, SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.spec_config import SpecMethod, SpeculativeConfig
from scheduler.spec_switch import AcceptanceSwitch, SwitchSettings

K = 3
DRAFTS = [1, 2, 3]


def _scheduler(*, switch_on: bool = True) -> Scheduler:
    config = SchedulerConfig(speculative=SpeculativeConfig(SpecMethod.NGRAM, K))
    scheduler = Scheduler(config, make_config(256, full(64), mamba(64, MambaCacheMode.NONE)))
    assert scheduler.spec is not None
    if not switch_on:
        scheduler.spec.switch = None
    params = SamplingParams(temperature=0, max_tokens=200)
    scheduler.add_request(Request("a", [5, 6, 7, 8, 9], params, scheduler.hash_block_size))
    return scheduler


def _verified(scheduler: Scheduler, num_accepted: int) -> int:
    """One step: the drafts it verified get `num_accepted` accepted; the next drafts are
    always DRAFTS. Returns the number of drafts verified."""
    out = scheduler.schedule()
    verified = out.scheduled_spec_tokens.get("a", [])
    accepted = DRAFTS[: min(num_accepted, len(verified))]
    runner = ModelRunnerOutput(
        req_ids=["a"], sampled_token_ids=[[*accepted, 50]], draft_token_ids={"a": DRAFTS}
    )
    scheduler.update_from_output(out, runner)
    return len(verified)


def _pattern(scheduler: Scheduler, steps: int, num_accepted: int) -> str:
    """'v' per step that verified drafts, '.' per plain step."""
    return "".join("v" if _verified(scheduler, num_accepted) else "." for _ in range(steps))


def test_rejected_drafts_pause_drafting_with_a_doubling_back_off() -> None:
    scheduler = _scheduler()
    # The first step has no drafts yet; the rate falls 1 -> 0.5 -> 0.25 -> 0.125 (< 0.2): pause 4,
    # probe (rejected: pause 8), probe (pause 16).
    assert _pattern(scheduler, 1 + 3 + 4 + 1 + 8 + 1 + 16 + 1, 0) == (
        ".vvv....v........v................v"
    )
    assert scheduler.spec is not None
    assert scheduler.spec.switch is not None
    assert scheduler.spec.switch.num_pauses == 4


def test_a_good_probe_resumes_drafting_and_resets_the_back_off() -> None:
    scheduler = _scheduler()
    assert _pattern(scheduler, 1 + 3 + 4, 0) == ".vvv...."
    assert _pattern(scheduler, 6, K) == "vvvvvv"  # a copy-heavy stretch: drafting resumes
    assert _pattern(scheduler, 3 + 4 + 1, 0) == "vvv....v"  # a pause of 4 again, not 16


def test_without_the_switch_rejected_drafts_are_verified_every_step() -> None:
    scheduler = _scheduler(switch_on=False)
    assert _pattern(scheduler, 12, 0) == "." + "v" * 11


def test_a_paused_request_gives_back_its_draft_state_slots() -> None:
    scheduler = _scheduler()
    manager = scheduler.kv_cache_manager
    _pattern(scheduler, 3, 0)
    free_while_drafting = manager.num_free_blocks
    _pattern(scheduler, 1, 0)  # the third rejection: paused
    assert manager.num_free_blocks == free_while_drafting + K  # one recurrent group
    manager.check_invariants()
    assert _pattern(scheduler, 5, 0) == "....v"  # the probe takes the slots again
    assert manager.num_free_blocks == free_while_drafting + K  # and paused again: given back
    manager.check_invariants()


def test_finished_requests_are_forgotten() -> None:
    switch = AcceptanceSwitch(SwitchSettings())
    for _ in range(3):
        switch.record("a", K, 0)
    assert switch.is_paused("a")
    switch.forget("a")
    assert switch.allows("a")
    assert not switch.is_paused("a")


@pytest.mark.parametrize(
    ("key", "settings"),
    [
        ("min_acceptance", {"min_acceptance": 1.5}),
        ("smoothing", {"smoothing": 0.0}),
        ("first_backoff", {"first_backoff": 8, "max_backoff": 4}),
    ],
)
def test_bad_settings_name_the_key(key: str, settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=key):
        SwitchSettings(**settings)

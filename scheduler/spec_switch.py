"""The acceptance-aware switch of speculative decoding: a request whose drafts keep being
rejected stops verifying them for a while, then tries again.

A verify step costs more than a plain decode step (k more positions in every layer, the
rejection sampler), and pays off only through accepted drafts. Per drafting request the switch
keeps a smoothed acceptance rate (accepted / verified drafts of its verify steps):

    rate < min_acceptance        pause: the next `backoff` decode steps verify no drafts (and
                                 the request gives back its draft-state slots); the back-off
                                 doubles (up to max_backoff) for the next pause
    after the pause              one probe step verifies drafts again; its rate alone decides
                                 (the smoothed rate restarts at the threshold): a good probe
                                 resumes drafting and resets the back-off (the request entered
                                 a copy-heavy stretch), a bad one pauses again for longer

Outputs never change (the verifier is lossless either way); only the step cost does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SwitchSettings:
    """When a request's drafting pauses, and for how long."""

    min_acceptance: float = 0.2
    """Smoothed acceptance rate below which drafting pauses."""
    smoothing: float = 0.5
    """Weight of the latest verify step in the smoothed rate."""
    first_backoff: int = 4
    """Decode steps without drafts after the first pause."""
    max_backoff: int = 64
    """Longest pause (each pause in a row doubles the last one)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not 1 <= self.first_backoff <= self.max_backoff:
            raise ValueError(
                "first_backoff must be >= 1 and <= max_backoff, got "
                f"{self.first_backoff} and {self.max_backoff}"
            )


DEFAULT_SWITCH = SwitchSettings()


@dataclass
class _Track:
    rate: float
    backoff: int
    paused_steps: int = 0


class AcceptanceSwitch:
    """Per-request pauses of drafting (one per scheduler)."""

    def __init__(self, settings: SwitchSettings) -> None:
        self.settings = settings
        self._tracks: dict[str, _Track] = {}
        self.num_pauses = 0
        """Pauses started so far (all requests)."""

    def allows(self, req_id: str) -> bool:
        """Whether this decode step of `req_id` may verify drafts; a paused request counts the
        step towards the end of its pause."""
        track = self._tracks.get(req_id)
        if track is None or track.paused_steps == 0:
            return True
        track.paused_steps -= 1
        return False

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> bool:
        """After a verify step of `num_drafts` drafts: True when the request pauses now."""
        settings = self.settings
        track = self._tracks.get(req_id)
        if track is None:
            track = self._tracks[req_id] = _Track(1.0, settings.first_backoff)
        fraction = num_accepted / num_drafts
        track.rate += settings.smoothing * (fraction - track.rate)
        if track.rate >= settings.min_acceptance:
            if fraction >= settings.min_acceptance:
                track.backoff = settings.first_backoff
            return False
        track.paused_steps = track.backoff
        track.backoff = min(2 * track.backoff, settings.max_backoff)
        track.rate = settings.min_acceptance  # the probe after the pause decides alone
        self.num_pauses += 1
        return True

    def is_paused(self, req_id: str) -> bool:
        track = self._tracks.get(req_id)
        return track is not None and track.paused_steps > 0

    def forget(self, req_id: str) -> None:
        """A finished request."""
        self._tracks.pop(req_id, None)

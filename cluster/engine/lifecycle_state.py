"""The engine's pause and sleep state (`cluster.engine.lifecycle` drives it; the core holds it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Lifecycle:
    """Whether the engine steps, and which memory of its ranks is asleep."""

    is_paused: bool = False
    sleep_level: int = 0
    asleep_tags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def is_sleeping(self) -> bool:
        """Paused or any memory asleep (as vLLM's `is_sleeping`)."""
        return self.is_paused or bool(self.asleep_tags)

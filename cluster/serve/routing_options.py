"""`RoutingOptions`: how `HybridRoutingPolicy` weighs predicted hits against load, and when a
request's prefix is pulled from a peer replica (`HybridPrefixRouter`'s request_router_kwargs)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingOptions:
    """How hits are weighed against load."""

    load_factor: float = 2.0
    """A replica takes a new request only while its requests in flight stay within this
    multiple of the mean (rounded up); >= 1."""
    min_in_flight_bound: int = 8
    """The in-flight bound is never below this: a batching engine serves a few requests about
    as fast as one, while a conversation sent away from its replica loses its whole hit."""
    work_factor: float = 1.25
    """Below a strong hit, a replica takes a new request only while its conversations'
    footprint stays within this multiple of the mean (a prefix cached in one place must not
    draw every new conversation there); >= 1."""
    strong_fraction: float = 0.5
    """A predicted hit covering this much of the prompt is the conversation's own history:
    only the in-flight bound can send it elsewhere."""
    match_fraction: float = 0.25
    """A request whose best predicted hit exceeds the shortest by less than this part of its
    prompt starts a new conversation (a prefix all replicas hold at most): it goes where the
    fewest conversations are, so conversations, and the cache they fill, spread evenly."""
    work_half_life_s: float = 60.0
    """Half-life with which a replica's conversations (their count and footprint) fade."""
    guess_ttl_s: float = 10.0
    """How long a guessed cached block counts before the replica's events must confirm it."""
    tier_hit_weight: float = 0.5
    """What a token the replica would load from its KV offload tier counts, in tokens of a hit
    on its device (a load is slower than a device hit, much faster than a recompute); 0..1."""
    event_age_steps: float = 10.0
    """Engine steps from the state a replica's events describe to the admission of a request
    routed now (the events' poll period in steps, and one): what the replica's running
    requests allocate meanwhile is anticipated as evicting its next free blocks."""

    pull_threshold_tokens: int | None = 256
    """A request sent away from the replica predicted to cache its prefix (load, a replica out
    of routing) pulls that prefix from it when the prefix leads the receiver's own predicted
    hit by at least this many tokens; otherwise it recomputes (None: never pull). Provisional:
    no pull-vs-recompute crossover has been measured on a GPU yet."""
    pull_timeout_s: float = 5.0
    """Deadline of a pull; past it the receiver recomputes."""
    drain_pull_s: float = 60.0
    """How long a replica that left routing (draining: scaled down or stopped) stays a pull
    source after it left, then is forgotten (the builder's default graceful_shutdown_timeout_s:
    the longest Serve lets it drain); 0: forgotten at once. A dead replica is forgotten at once."""
    drain_handoff_prefixes: int = 64
    """A replica Serve stops (scaled down) first has up to this many of its most recently used
    cached prefixes, each longer than `pull_threshold_tokens`, pulled by its peers, so the
    conversations continue there on their cache (0: off, they recompute)."""
    pressure_factor: float | None = 2.0
    """A conversation moves off its replica (its prefix pulled along) to the calmest allowed
    replica when its own evicts more than this multiple of that one's rate (evicted keys per
    pool block, over `pressure_half_life_s`) (None: never move for pool pressure); >= 1."""
    pressure_half_life_s: float = 2.0
    """Half-life with which a replica's evictions fade (a few of its conversations' turns)."""
    min_pressure: float = 0.2
    """Below this eviction rate (keys evicted over `pressure_half_life_s`, per pool block) a
    replica is under no pool pressure whatever the others evict."""

    def __post_init__(self) -> None:
        self._check_pull_and_pressure()
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")
        if self.min_in_flight_bound < 1:
            raise ValueError(f"min_in_flight_bound must be >= 1, got {self.min_in_flight_bound}")
        if self.work_factor < 1.0:
            raise ValueError(f"work_factor must be >= 1, got {self.work_factor}")
        if not 0.0 <= self.tier_hit_weight <= 1.0:
            raise ValueError(f"tier_hit_weight must be in [0, 1], got {self.tier_hit_weight}")

    def _check_pull_and_pressure(self) -> None:
        if self.pull_threshold_tokens is not None and self.pull_threshold_tokens < 1:
            raise ValueError(
                f"pull_threshold_tokens must be >= 1 (or null: never pull), "
                f"got {self.pull_threshold_tokens}"
            )
        if self.pull_timeout_s <= 0:
            raise ValueError(f"pull_timeout_s must be > 0, got {self.pull_timeout_s}")
        if self.drain_pull_s < 0:
            raise ValueError(f"drain_pull_s must be >= 0, got {self.drain_pull_s}")
        if self.drain_handoff_prefixes < 0:
            raise ValueError(
                f"drain_handoff_prefixes must be >= 0 (0: off), got {self.drain_handoff_prefixes}"
            )
        if self.pressure_factor is not None and self.pressure_factor < 1:
            raise ValueError(f"pressure_factor must be >= 1 (or null), got {self.pressure_factor}")
        if self.min_pressure < 0:
            raise ValueError(f"min_pressure must be >= 0, got {self.min_pressure}")
        if self.pressure_half_life_s <= 0:
            raise ValueError(f"pressure_half_life_s must be > 0, got {self.pressure_half_life_s}")

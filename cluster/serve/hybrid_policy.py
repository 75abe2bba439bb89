"""The routing decision of `HybridPrefixRouter`, free of Ray so the benchmark drives the same code.

Per replica: a `CacheIndex` (the replica's prefix-cache keys from its KV events, plus guesses for
what was just sent there) and the requests in flight. A request goes to the replica whose index
predicts the longest hit valid for every KV cache group, among the replicas under the load bound
(bounded-load consistent hashing: none takes more than `load_factor` times the mean share of the
requests in flight, counting the new one); ties go to the least loaded, then the emptiest cache.

    choose(candidates, prompt) ─► ranks [[best], [others by preference]]
    routed(replica, prompt)     ─► in flight + 1, index guesses the prompt's blocks
    completed(replica)          ─► in flight - 1
    replay(replica, window)     ─► index follows the replica's events
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from scheduler.block_hash import BlockHash
from scheduler.kv_cache.cache_index import CacheIndex
from scheduler.kv_cache.events import KVEventWindow

Key = TypeVar("Key", bound=Hashable)


@dataclass(frozen=True)
class RoutingOptions:
    """How hits are weighed against load."""

    load_factor: float = 2.0
    """A replica takes a new request only while its requests in flight stay within this
    multiple of the mean (rounded up); >= 1."""
    match_fraction: float = 0.5
    """A request whose best predicted hit covers less of its prompt than this starts a new
    conversation (a shared system prompt at most): it goes where the least prompt work was sent
    lately, so conversations, and the cache they fill, spread evenly."""
    work_half_life_s: float = 60.0
    """Half-life of the recent prompt work counted per replica."""
    guess_ttl_s: float = 30.0
    """How long a guessed cached block counts before the replica's events must confirm it."""

    def __post_init__(self) -> None:
        if self.load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {self.load_factor}")


class PromptKeys(NamedTuple):
    """A prompt as the indexes read it."""

    block_hashes: list[BlockHash]
    num_tokens: int


class Candidate(NamedTuple):
    """One replica's case for a request."""

    predicted_hit: int
    in_flight: int
    recent_work: float
    kv_usage: float


@dataclass
class _Replica:
    index: CacheIndex | None = None
    in_flight: int = 0
    kv_usage: float = 0.0
    work: float = 0.0
    """Prompt tokens routed here, decayed with `work_half_life_s`, as of `work_time`."""
    work_time: float = 0.0

    def recent_work(self, now: float, half_life: float) -> float:
        return self.work * math.pow(0.5, max(now - self.work_time, 0.0) / half_life)


@dataclass
class HybridRoutingPolicy(Generic[Key]):
    """Per-replica cache indexes and loads, and the choice they imply."""

    options: RoutingOptions = field(default_factory=RoutingOptions)
    _replicas: dict[Key, _Replica] = field(default_factory=dict)

    def replay(self, key: Key, window: KVEventWindow, kv_usage: float = 0.0) -> None:
        """Bring the replica's index up to its event log (the first window creates it)."""
        replica = self._replicas.setdefault(key, _Replica())
        if replica.index is None or replica.index.groups != window.groups:
            replica.index = CacheIndex(window.groups, self.options.guess_ttl_s)
        replica.index.replay(window)
        replica.kv_usage = kv_usage

    def keep_only(self, keys: Sequence[Key]) -> None:
        """Forget replicas that are gone (dead, or scaled down)."""
        alive = set(keys)
        for key in [key for key in self._replicas if key not in alive]:
            del self._replicas[key]

    def prompt_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> PromptKeys | None:
        """The prompt's block hashes, once some replica's index says how to hash (else None)."""
        index = next((r.index for r in self._replicas.values() if r.index is not None), None)
        if index is None:
            return None
        return PromptKeys(index.block_hashes(token_ids, cache_salt), len(token_ids))

    def candidate(self, key: Key, prompt: PromptKeys | None, now: float) -> Candidate:
        replica = self._replicas.get(key) or _Replica()
        hit = 0
        if prompt is not None and replica.index is not None:
            hit = replica.index.predict_hit(prompt.block_hashes, prompt.num_tokens, now)
        work = replica.recent_work(now, self.options.work_half_life_s)
        return Candidate(hit, replica.in_flight, work, replica.kv_usage)

    def choose(self, keys: Sequence[Key], prompt: PromptKeys | None, now: float) -> list[list[Key]]:
        """Preference ranks over `keys`: the best replica alone, then the rest in order."""
        if not keys:
            return []
        cases = {key: self.candidate(key, prompt, now) for key in keys}
        total = sum(case.in_flight for case in cases.values()) + 1
        bound = math.ceil(self.options.load_factor * total / len(keys))
        allowed = [case for case in cases.values() if case.in_flight < bound]
        best_hit = max(case.predicted_hit for case in allowed)
        num_tokens = prompt.num_tokens if prompt is not None else 0
        follows_hit = best_hit >= self.options.match_fraction * num_tokens > 0
        ordered = sorted(
            keys, key=lambda key: (cases[key].in_flight >= bound, *_rank(cases[key], follows_hit))
        )
        return [ordered[:1], ordered[1:]] if len(ordered) > 1 else [ordered]

    def predicted_hit(self, key: Key, prompt: PromptKeys | None, now: float) -> int:
        return self.candidate(key, prompt, now).predicted_hit

    def routed(self, key: Key, prompt: PromptKeys | None, now: float) -> None:
        """A request went to `key`: count it, and guess its prompt will be cached there."""
        replica = self._replicas.setdefault(key, _Replica())
        replica.in_flight += 1
        if prompt is not None:
            replica.work = replica.recent_work(now, self.options.work_half_life_s)
            replica.work += prompt.num_tokens
            replica.work_time = now
        if prompt is not None and replica.index is not None:
            replica.index.guess_stored(prompt.block_hashes, prompt.num_tokens, now)

    def completed(self, key: Key) -> None:
        replica = self._replicas.get(key)
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1

    def in_flight(self, key: Key) -> int:
        replica = self._replicas.get(key)
        return replica.in_flight if replica is not None else 0


def _rank(case: Candidate, follows_hit: bool) -> tuple[float, ...]:
    """Sort key: the longest hit first, or (a new conversation) the least recent work first."""
    if follows_hit:
        return (-case.predicted_hit, case.in_flight, case.recent_work, case.kv_usage)
    return (case.recent_work, case.in_flight, -case.predicted_hit, case.kv_usage)

"""The routing decision of `HybridPrefixRouter`, free of Ray so the benchmark drives the same code.

Per replica: a `CacheIndex` (the replica's prefix-cache keys from its KV events, plus guesses for
what was just sent there), the requests in flight, and its recent conversations: how many, and
their footprint (the tokens of each one's latest prompt; a conversation counts once, on the
replica its latest prompt went to). For a request:

  1. every replica's predicted hit: the longest prefix valid for every KV cache group at once;
  2. replicas whose requests in flight would pass `load_factor` x the mean (and at least
     `min_in_flight_bound`) are out (bounded load); unless the request continues a
     conversation (it extends a prompt routed to one of the others, or its best hit covers
     >= `strong_fraction` of it), so are replicas whose conversations' footprint would pass
     `work_factor` x the mean;
  3. among the rest: the replica whose conversation the request continues, then the longest
     hit if it exceeds the shortest by >= `match_fraction` of the prompt (a prefix every
     replica holds, e.g. a shared system prompt, says nothing), else (a new conversation) a
     replica with the request's LoRA adapter loaded, then the fewest conversations, then the
     least footprint; excluded replicas come last, in the same order;
  4. pool pressure: a conversation continuing on a replica that evicts (cached keys per pool
     block, recently) more than `pressure_factor` x the calmest allowed replica moves to that
     one: its prefix would likely be evicted before its next turn where it is; it is pulled
     along (`pull_source`), and the sender demotes what it sent.

A LoRA adapter is part of the prompt's block hashes (a hit is a hit with that adapter), and
a replica that has the adapter loaded (its routing stats, or a request for it just sent there)
is exempt from the footprint bound while some allowed replica lacks it: the adapter draws its
conversations until the in-flight bound sends one elsewhere (which then loads it too).

    choose(candidates, prompt) ─► ranks [[best], [others by preference]]
    pull_source(chosen, prompt) ─► the replica to pull the prefix from (its predicted hit
                                   leads the chosen one's by >= a threshold), or None
    routed(replica, prompt)     ─► in flight + 1, the prompt's conversation moves to it (counted
                                   with this prompt), index guesses the prompt's blocks (and
                                   that the prompt's adapter is loaded there)
    completed(replica)          ─► in flight - 1
    replay(replica, window)     ─► index follows the replica's events
    keep_routable(replicas)     ─► the others left routing: pull sources for `drain_pull_s`,
                                   then forgotten (`forget`: at once, a dead replica)
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from cluster.serve.routing_options import RoutingOptions
from scheduler.block_hash import BlockHash
from scheduler.kv_cache.cache_index import CacheIndex
from scheduler.kv_cache.events import KVEventWindow

Key = TypeVar("Key", bound=Hashable)
MAX_PROMPT_ENDS = 1 << 16
"""Prompt ends remembered per replica (the oldest are forgotten first)."""
MAX_UNINDEXED_PROMPTS = 256
"""Prompts remembered per replica until its first events arrive."""


class PromptKeys(NamedTuple):
    """A prompt as the indexes read it."""

    block_hashes: list[BlockHash]
    num_tokens: int
    token_ids: Sequence[int] = ()
    cache_salt: str | None = None
    adapter: str | None = None
    """The LoRA adapter the request runs with (None: the base model)."""


class PullHint(NamedTuple, Generic[Key]):
    """Where the prefix of a request sent away from it is predicted to be cached."""

    source: Key
    num_tokens: int
    """The prefix tokens the source is predicted to hold."""
    lead: int
    """How many of them the receiving replica is predicted to lack."""


class Candidate(NamedTuple):
    """One replica's case for a request."""

    predicted_hit: int
    in_flight: int
    recent_work: float
    """The footprint of its recent conversations (tokens of their latest prompts)."""
    kv_usage: float
    continues: bool = False
    """The prompt extends one routed there (through that prompt's last full block)."""
    conversations: float = 0.0
    """Its recent conversations (each fading with `work_half_life_s`)."""
    has_adapter: bool = True
    """The request's LoRA adapter is loaded there (True for a base-model request)."""
    eviction_rate: float | None = None
    """Keys it evicted recently per pool block (None: its pool size is not reported)."""


@dataclass
class _Replica:
    index: CacheIndex | None = None
    in_flight: int = 0
    kv_usage: float = 0.0
    work: float = 0.0
    """The conversations' footprint: the tokens of the latest prompt of each conversation
    routed here, each decayed with `work_half_life_s` since, as of `work_time`."""
    work_time: float = 0.0
    prompt_ends: dict[BlockHash, tuple[int, float]] = field(default_factory=dict)
    """Hash of the last full block of each conversation's latest prompt routed here (oldest
    first) -> its tokens and when it was routed."""
    unindexed: list[tuple[PromptKeys, float]] = field(default_factory=list)
    """Prompts routed here before its first events (guessed once the index exists)."""

    conversations: float = 0.0
    """The conversations routed here, counted like `work` (1 each)."""
    adapters: frozenset[str] = frozenset()
    """The LoRA adapters the replica reported loaded."""
    sent_adapters: dict[str, float] = field(default_factory=dict)
    """Adapters of requests routed here -> when (loaded there by now, until reports say)."""
    num_blocks: int = 0
    """The replica's pool size in blocks, as its events report it (0: not reported)."""
    evictions: float = 0.0
    """Keys its events removed, each fading with `pressure_half_life_s`, as of `evict_time`."""
    evict_time: float = 0.0
    left_at: float | None = None
    """When it left routing (None: routable); a pull source for `drain_pull_s` after."""

    def recent_evictions(self, now: float, half_life: float) -> float:
        return self.evictions * _decay(now - self.evict_time, half_life)

    def has_adapter(self, adapter: str | None, now: float, ttl: float) -> bool:
        if adapter is None or adapter in self.adapters:
            return True
        sent = self.sent_adapters.get(adapter)
        return sent is not None and now - sent <= ttl

    def recent_work(self, now: float, half_life: float) -> float:
        return self.work * _decay(now - self.work_time, half_life)

    def recent_conversations(self, now: float, half_life: float) -> float:
        return self.conversations * _decay(now - self.work_time, half_life)

    def add_work(self, tokens: float, count: float, now: float, half_life: float) -> None:
        self.work = max(self.recent_work(now, half_life) + tokens, 0.0)
        self.conversations = max(self.recent_conversations(now, half_life) + count, 0.0)
        self.work_time = now

    def forget_prompts(
        self, block_hashes: Sequence[BlockHash], now: float, half_life: float
    ) -> None:
        """Take out the earlier prompts of the conversation these hashes continue (a
        conversation counts with its latest prompt only, wherever that went)."""
        ends = self.prompt_ends
        for block_hash in block_hashes:
            earlier = ends.pop(block_hash, None)
            if earlier is not None:
                tokens, routed_at = earlier
                decay = _decay(now - routed_at, half_life)
                self.add_work(-tokens * decay, -decay, now, half_life)


@dataclass
class HybridRoutingPolicy(Generic[Key]):
    """Per-replica cache indexes and loads, and the choice they imply."""

    options: RoutingOptions = field(default_factory=RoutingOptions)
    _replicas: dict[Key, _Replica] = field(default_factory=dict)

    def replay(
        self,
        key: Key,
        window: KVEventWindow,
        kv_usage: float = 0.0,
        adapters: Sequence[str] | None = None,
        now: float = 0.0,
    ) -> None:
        """Bring the replica's index up to its event log (the first window creates it), and
        its loaded LoRA adapters to its report (None: unchanged); `now`: when it was polled."""
        replica = self._replicas.setdefault(key, _Replica())
        if replica.index is None or replica.index.groups != window.groups:
            replica.index = CacheIndex(
                window.groups, self.options.guess_ttl_s, self.options.event_age_steps
            )
            for prompt, routed_at in replica.unindexed:
                hashes = replica.index.block_hashes(prompt.token_ids, prompt.cache_salt)
                replica.index.guess_stored(hashes, prompt.num_tokens, routed_at)
                if hashes:  # its conversation's next turn will find it
                    _remember_end(replica.prompt_ends, hashes, (prompt.num_tokens, routed_at))
            replica.unindexed.clear()
        half_life = self.options.pressure_half_life_s
        evicted = _num_removed(window, replica.index.next_seq)
        replica.evictions = replica.recent_evictions(now, half_life) + evicted
        replica.evict_time = now
        replica.index.replay(window)
        replica.kv_usage = kv_usage
        replica.num_blocks = window.num_blocks
        if adapters is not None:
            replica.adapters = frozenset(adapters)

    @property
    def replicas(self) -> tuple[Key, ...]:
        """Replicas with an index or a load."""
        return tuple(self._replicas)

    def keep_routable(self, keys: Sequence[Key], now: float) -> list[Key]:
        """`keys` are the routable replicas; each other one left routing (draining: scaled
        down, stopped) and stays a pull source for `drain_pull_s` after it left, then is
        forgotten. Returns the replicas that left routing with this call."""
        routable = set(keys)
        just_left = []
        for key, replica in list(self._replicas.items()):
            if key in routable:
                replica.left_at = None
            elif replica.left_at is None:
                replica.left_at = now
                just_left.append(key)
            if not self._is_source(replica, now):
                del self._replicas[key]
        return just_left

    def forget(self, key: Key) -> None:
        """Forget a replica at once (its actor died: nothing can be pulled from it)."""
        self._replicas.pop(key, None)

    def _is_source(self, replica: _Replica, now: float) -> bool:
        """Routable, or left routing less than `drain_pull_s` ago."""
        left_at = replica.left_at
        return left_at is None or now - left_at < self.options.drain_pull_s

    def prompt_keys(
        self, token_ids: Sequence[int], cache_salt: str | None, adapter: str | None = None
    ) -> PromptKeys:
        """The prompt's block hashes (none until some replica's index says how to hash);
        `cache_salt` is the block-0 key the replicas hash with (adapter included)."""
        index = next((r.index for r in self._replicas.values() if r.index is not None), None)
        hashes = index.block_hashes(token_ids, cache_salt) if index is not None else []
        return PromptKeys(hashes, len(token_ids), token_ids, cache_salt, adapter)

    def candidate(self, key: Key, prompt: PromptKeys | None, now: float) -> Candidate:
        replica = self._replicas.get(key) or _Replica()
        hit = 0
        continues = False
        if prompt is not None and replica.index is not None:
            hit = self._predicted_hit(replica.index, prompt, now)
            ends = replica.prompt_ends
            continues = any(h in ends for h in prompt.block_hashes)
        half_life = self.options.work_half_life_s
        work = replica.recent_work(now, half_life)
        conversations = replica.recent_conversations(now, half_life)
        adapter = prompt.adapter if prompt is not None else None
        has_adapter = replica.has_adapter(adapter, now, self.options.guess_ttl_s)
        rate = None
        if replica.num_blocks:
            evictions = replica.recent_evictions(now, self.options.pressure_half_life_s)
            rate = evictions / replica.num_blocks
        return Candidate(
            hit,
            replica.in_flight,
            work,
            replica.kv_usage,
            continues,
            conversations,
            has_adapter,
            rate,
        )

    def _predicted_hit(self, index: CacheIndex, prompt: PromptKeys, now: float) -> int:
        """The device hit, plus the tokens only the offload tier holds at `tier_hit_weight`."""
        hit = index.predict_hit(prompt.block_hashes, prompt.num_tokens, now)
        tiered = index.predict_tier_hit(prompt.block_hashes, prompt.num_tokens)
        return hit + int(self.options.tier_hit_weight * max(tiered - hit, 0))

    def choose(self, keys: Sequence[Key], prompt: PromptKeys | None, now: float) -> list[list[Key]]:
        """Preference ranks over `keys`: the best replica alone, then the rest in order."""
        if not keys:
            return []
        cases = {key: self.candidate(key, prompt, now) for key in keys}
        num_tokens = prompt.num_tokens if prompt is not None else 0
        options = self.options
        over = _over_in_flight(cases, options.load_factor, options.min_in_flight_bound)
        continued = any(case.continues for key, case in cases.items() if key not in over)
        if not continued and _best_hit(cases, over) < options.strong_fraction * num_tokens:
            # Not a conversation's own history: keep shared prefixes from drawing every
            # new conversation to the replicas that happen to hold them (an adapter may).
            holders = _adapter_holders(cases, over)
            over |= _over_work(cases, num_tokens, options.work_factor) - holders
        follows_hit = _distinct_hit(cases, over) >= options.match_fraction * num_tokens > 0
        ordered = sorted(keys, key=lambda key: _order(key in over, cases[key], follows_hit))
        relief = self._pressure_target(cases, over)
        if relief is not None:
            ordered = [relief, *(key for key in ordered if key != relief)]
        return [ordered[:1], ordered[1:]] if len(ordered) > 1 else [ordered]

    def _pressure_target(self, cases: Mapping[Key, Candidate], over: set[Key]) -> Key | None:
        """Where a conversation continuing on a replica under pool pressure moves: the calmest
        allowed replica, when the conversation's own evicts more than `pressure_factor` x its
        rate; None: it stays."""
        factor = self.options.pressure_factor
        allowed = {key: case for key, case in cases.items() if key not in over}
        home = next((case for case in allowed.values() if case.continues), None)
        if factor is None or home is None or home.eviction_rate is None:
            return None
        if home.eviction_rate < self.options.min_pressure:
            return None
        rates = {  # moving must not leave the target with more conversations than home had
            key: case.eviction_rate
            for key, case in allowed.items()
            if not case.continues
            and case.eviction_rate is not None
            and round(case.conversations) <= round(home.conversations)
        }
        calmest = min(rates, key=rates.__getitem__, default=None)
        if calmest is None or home.eviction_rate <= factor * rates[calmest]:
            return None
        return calmest

    def predicted_hit(self, key: Key, prompt: PromptKeys | None, now: float) -> int:
        """`candidate(...).predicted_hit`, without the rest of the candidate."""
        replica = self._replicas.get(key)
        if prompt is None or replica is None or replica.index is None:
            return 0
        return self._predicted_hit(replica.index, prompt, now)

    def pull_source(
        self, chosen: Key, prompt: PromptKeys | None, now: float, threshold: int
    ) -> PullHint[Key] | None:
        """The replica `chosen` should pull the prompt's prefix from: the one (routable, or
        left routing within `drain_pull_s`) predicted to hold the longest prefix, when that
        leads `chosen`'s own predicted hit by >= `threshold` tokens; None: recompute."""
        sources = [key for key, r in self._replicas.items() if self._is_source(r, now)]
        if prompt is None or not sources:
            return None
        hits = {key: self.predicted_hit(key, prompt, now) for key in sources}
        source = max(hits, key=hits.__getitem__)
        lead = hits[source] - hits.get(chosen, 0)
        if source == chosen or lead < max(threshold, 1):
            return None
        return PullHint(source, hits[source], lead)

    def routed(self, key: Key, prompt: PromptKeys | None, now: float) -> None:
        """A request went to `key`: count it, and guess its prompt will be cached there."""
        replica = self._replicas.setdefault(key, _Replica())
        replica.in_flight += 1
        half_life = self.options.work_half_life_s
        if prompt is not None:
            for other in self._replicas.values():
                other.forget_prompts(prompt.block_hashes, now, half_life)
            replica.add_work(prompt.num_tokens, 1.0, now, half_life)
        if prompt is not None and prompt.adapter is not None:
            replica.sent_adapters[prompt.adapter] = now
        if prompt is not None and prompt.block_hashes:
            _remember_end(replica.prompt_ends, prompt.block_hashes, (prompt.num_tokens, now))
        if prompt is not None and replica.index is not None:
            replica.index.guess_stored(prompt.block_hashes, prompt.num_tokens, now)
        elif prompt is not None and len(replica.unindexed) < MAX_UNINDEXED_PROMPTS:
            replica.unindexed.append((prompt, now))

    def completed(self, key: Key) -> None:
        replica = self._replicas.get(key)
        if replica is not None and replica.in_flight > 0:
            replica.in_flight -= 1

    def in_flight(self, key: Key) -> int:
        replica = self._replicas.get(key)
        return replica.in_flight if replica is not None else 0


def _num_removed(window: KVEventWindow, next_seq: int) -> int:
    """Keys the window's batches from `next_seq` on remove from the device pool."""
    new = window.batches[max(next_seq - window.first_seq, 0) :]
    return sum(len(keys) for batch in new for keys in batch.removed)


def _decay(age: float, half_life: float) -> float:
    return math.pow(0.5, max(age, 0.0) / half_life)


def _remember_end(
    ends: dict[BlockHash, tuple[int, float]], block_hashes: list[BlockHash], end: tuple[int, float]
) -> None:
    """Keep the prompt's last block hash: a later prompt holding it extends this one through
    its last full block (missed when that block holds the generation prompt: then the hit's
    length decides, as for any other request)."""
    ends.pop(block_hashes[-1], None)
    ends[block_hashes[-1]] = end
    while len(ends) > MAX_PROMPT_ENDS:
        del ends[next(iter(ends))]


def _over_in_flight(cases: Mapping[Key, Candidate], load_factor: float, min_bound: int) -> set[Key]:
    """Replicas whose requests in flight would pass `load_factor` times the mean (and
    `min_bound`)."""
    total = sum(case.in_flight for case in cases.values()) + 1
    bound = max(math.ceil(load_factor * total / len(cases)), min_bound)
    return {key for key, case in cases.items() if case.in_flight >= bound}


def _over_work(cases: Mapping[Key, Candidate], num_tokens: int, work_factor: float) -> set[Key]:
    """Replicas whose conversations' footprint would pass `work_factor` times the mean."""
    work = sum(case.recent_work for case in cases.values()) + num_tokens
    bound = max(work_factor * work / len(cases), num_tokens)  # an idle replica takes it
    return {key for key, case in cases.items() if case.recent_work + num_tokens > bound}


def _adapter_holders(cases: Mapping[Key, Candidate], excluded: set[Key]) -> set[Key]:
    """Allowed replicas with the request's adapter loaded, when some allowed replica lacks it
    (none otherwise: then the adapter says nothing of where the request goes)."""
    allowed = {key: case for key, case in cases.items() if key not in excluded}
    holders = {key for key, case in allowed.items() if case.has_adapter}
    return holders if len(holders) < len(allowed) else set()


def _distinct_hit(cases: Mapping[Key, Candidate], excluded: set[Key]) -> int:
    """How much longer the best predicted hit is than the shortest: what only some replicas
    hold (a prefix all of them hold, e.g. a shared system prompt, says nothing of where the
    request's conversation lives)."""
    allowed = [case.predicted_hit for key, case in cases.items() if key not in excluded]
    hits = allowed or [case.predicted_hit for case in cases.values()]
    return max(hits) - min(hits)


def _best_hit(cases: Mapping[Key, Candidate], excluded: set[Key]) -> int:
    allowed = [case for key, case in cases.items() if key not in excluded]
    return max(case.predicted_hit for case in allowed or cases.values())


def _order(excluded: bool, case: Candidate, follows_hit: bool) -> tuple[float, ...]:
    """Sort key: allowed replicas first, among them the one the conversation continues on
    (even if its history was evicted there: it comes back cached where it stays), then
    `_rank`."""
    return (excluded, not case.continues, *_rank(case, follows_hit))


def _rank(case: Candidate, follows_hit: bool) -> tuple[float, ...]:
    """Sort key: the longest hit first (then the adapter loaded), or (a new conversation) the
    adapter loaded, then the fewest conversations (in whole numbers: they fade slowly), then
    the least footprint."""
    lacks = not case.has_adapter
    if follows_hit:
        return (-case.predicted_hit, lacks, case.in_flight, case.recent_work, case.kv_usage)
    conversations = round(case.conversations)
    return (
        lacks,
        conversations,
        case.recent_work,
        case.in_flight,
        -case.predicted_hit,
        case.kv_usage,
    )

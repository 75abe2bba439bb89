"""The routing benchmark's simulation compares like with like: every router and the one-replica
reference play the same trace, the hybrid router can hash prompts from the first request on, and
the random fixed placements are balanced."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from benchmarks.routing_sim import (
    FixedPlacement,
    HybridPrefix,
    RoundRobin,
    Router,
    SimReplica,
    Workload,
    balanced_placements,
    model_config,
    run,
)
from scheduler.config import SchedulerConfig

SCHED = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4096)
WORKLOAD = Workload(num_sessions=6, num_turns=3, seed=5)


class Recording:
    """A router that notes every prompt's length per session, then lets `inner` choose."""

    def __init__(self, inner: Router) -> None:
        self.inner = inner
        self.name = inner.name
        self.prompts: dict[int, list[int]] = {}

    def choose(
        self, replicas: list[SimReplica], token_ids: list[int], now: int, session: int
    ) -> int:
        self.prompts.setdefault(session, []).append(len(token_ids))
        return self.inner.choose(replicas, token_ids, now, session)

    def start(self, replicas: list[SimReplica]) -> None:
        self.inner.start(replicas)

    def on_step(self, replicas: list[SimReplica], now: int) -> None:
        self.inner.on_step(replicas, now)

    def finished(self, replica: int) -> None:
        self.inner.finished(replica)


def _prompts(
    num_replicas: int, num_blocks: int, make_inner: Callable[[], Router] = RoundRobin
) -> dict[int, list[int]]:
    """Each session's prompt lengths, turn by turn, as the router saw them."""
    recorders: list[Recording] = []

    def make_router(n: int) -> Router:
        recorders.append(Recording(make_inner()))
        return recorders[-1]

    run(WORKLOAD, model_config("sliding+full", num_blocks), SCHED, num_replicas, make_router)
    return recorders[0].prompts


def test_every_router_and_the_reference_play_the_same_trace() -> None:
    """Turns finish in another order on one big replica than on two small ones, and with
    another router: each session's prompts are still the same lengths."""
    reference = _prompts(1, 241)
    assert len(reference) == WORKLOAD.num_sessions
    assert all(len(lengths) == WORKLOAD.num_turns for lengths in reference.values())
    assert _prompts(2, 121) == reference
    assert _prompts(2, 121, lambda: FixedPlacement([0, 0, 0, 1, 1, 1])) == reference


def test_the_router_hashes_the_first_prompts() -> None:
    """Its first poll comes before traffic: the second conversation's first prompt is predicted
    to hit the system prompt the first one is computing, before any event says so."""
    replicas = [SimReplica(model_config("sliding+full", 121), SCHED, True) for _ in range(2)]
    router = HybridPrefix(2, delay=10, load_factor=2.0)
    router.start(replicas)
    system = list(range(1, WORKLOAD.system_tokens + 1))
    first, second = system + [500] * 40, system + [600] * 40
    chosen = router.choose(replicas, first, 0, 0)
    keys = router.policy.prompt_keys(second, None)
    assert keys.block_hashes
    assert router.policy.predicted_hit(chosen, keys, 0.0) == WORKLOAD.system_tokens


def test_random_placements_are_balanced_and_repeatable() -> None:
    placements = balanced_placements(10, 4, 5, seed=3)
    assert len(placements) == 5
    for placement in placements:
        counts = Counter(placement)
        assert set(counts) == {0, 1, 2, 3}
        assert max(counts.values()) - min(counts.values()) <= 1
    assert balanced_placements(10, 4, 5, seed=3) == placements
    assert balanced_placements(10, 4, 5, seed=4) != placements

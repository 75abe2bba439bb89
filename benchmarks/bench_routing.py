"""Routing across replicas that knows each replica's hybrid cache: simulated replicas.

Per model (sliding window + full attention, Mamba + full attention), session count and replica
count, plays the same multi-session chat trace (`routing_sim`) through round-robin, Ray's
prefix-cache affinity policy and `HybridRoutingPolicy` (without, and with pulls of a prefix from
the replica holding it: `--pull-threshold`), and, as the reference, through one
replica holding the combined pool (and the combined batch limits). Prints the cluster prefix-cache
hit rate against the reference, max/mean load over replicas (requests routed, tokens computed),
and for our router how far the predicted hit is from the hit the engine got.

With `--drain`, only a replica drained a third into the run: of the turns that leave it, the
tokens of their earlier history computed again, pulls off against on (same trace).

With `--serve`, then a short real-Serve run (`routing_serve`): two CPU replicas of a tiny
sliding-window hybrid, chat sessions over HTTP, per router and HTTP ingress (HAProxy and Serve's
proxy, one Ray instance) the hit rate of the later turns.

    .venv/bin/python benchmarks/bench_routing.py [--quick] [--delay 10] [--load-factor 2.0]
        [--pull-threshold 64] [--pull-only] [--pressure-factor 2|off] [--seeds N]
        [--cases 8/2,32/4] [--models sliding+full] [--pressures heavy] [--drain]
        [--serve [--serve-sessions 8] [--serve-ingress both|haproxy|proxy]]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from routing_sim import (
    MODELS,
    FixedPlacement,
    HybridPrefix,
    RayPrefixAffinity,
    RoundRobin,
    Router,
    RunResult,
    Workload,
    balanced_placements,
    model_config,
    run,
)

from cluster.serve.routing_options import RoutingOptions
from scheduler.config import SchedulerConfig

GRID = [(8, 2), (32, 4), (64, 2), (128, 4), (256, 8)]
QUICK_GRID = [(8, 2), (32, 4)]
PRESSURES = {"heavy": 40, "moderate": 60}
"""Pool blocks per session over the cluster (16-token blocks): 40 holds about half of what the
sessions' final histories need in the two groups, 60 about three quarters."""
HIT_GOAL = 0.9
"""Cluster hit rate against one replica holding the combined pool."""
LOAD_GOAL = 1.3
"""Max/mean over replicas, of requests routed and of tokens computed."""
ERROR_GOAL = 0.05
"""Σ|predicted - actual hit| / Σ actual hit."""
PULL = "hybrid-prefix + pull (ours)"


def _imbalance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def _relative_errors(result: RunResult) -> list[float]:
    """Per request: |predicted - actual| / actual hit tokens (a hit predicted where the engine
    found none counts as 100 %, none predicted and none found as 0)."""
    return [abs(p - a) / a if a else float(p > 0) for p, a in result.prediction_pairs]


def _total_error(result: RunResult) -> float:
    """Σ|predicted - actual| / Σ actual hit tokens."""
    pairs = result.prediction_pairs
    return sum(abs(p - a) for p, a in pairs) / max(sum(a for _, a in pairs), 1)


def _prediction_error(result: RunResult) -> str:
    """Mean and p90 of the per-request relative error, and Σ|predicted - actual| / Σ actual."""
    errors = sorted(_relative_errors(result))
    mean = sum(errors) / len(errors)
    p90 = errors[min(int(0.9 * len(errors)), len(errors) - 1)]
    return f"{mean:.1%} / {p90:.1%} / {_total_error(result):.1%}"


@dataclass
class CaseResult:
    """One case (model, pressure, sessions, replicas) on one trace, ratios to the reference."""

    reference_hit_rate: float
    routers: dict[str, RunResult]

    def ratio(self, result: RunResult) -> float:
        return result.hit_rate / max(self.reference_hit_rate, 1e-9)


def _fixed(placement: list[int]) -> Callable[[int], Router]:
    return lambda num_replicas: FixedPlacement(placement)


def measure_case(
    model: str, pressure: str, sessions: int, replicas: int, args: argparse.Namespace, seed: int
) -> CaseResult:
    workload = Workload(num_sessions=sessions, num_turns=args.turns, seed=seed)
    total_blocks = PRESSURES[pressure] * sessions
    per_replica = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=8192)
    config = model_config(model, total_blocks // replicas + 1)
    whole = replace(per_replica, max_num_seqs=32 * replicas, max_num_batched_tokens=1024 * replicas)
    reference = run(
        workload, model_config(model, total_blocks + 1), whole, 1, lambda n: RoundRobin()
    )
    routers: dict[str, Callable[[int], Router]] = {
        "round-robin": lambda n: RoundRobin(),
        "ray-prefix-affinity": lambda n: RayPrefixAffinity(n),
        "hybrid-prefix (ours)": lambda n: HybridPrefix(n, args.delay, args.load_factor),
        PULL: lambda n: HybridPrefix(
            n, args.delay, args.load_factor, args.pull_threshold, args.pressure_factor
        ),
    }
    if args.pull_only:
        routers = {PULL: routers[PULL]}
    placements = balanced_placements(sessions, replicas, args.placements, seed)
    for number, placement in enumerate(placements):
        routers[f"placement {number}"] = _fixed(placement)
    results = {
        name: run(workload, config, per_replica, replicas, make) for name, make in routers.items()
    }
    return CaseResult(reference.hit_rate, results)


def measure(
    model: str, pressure: str, sessions: int, replicas: int, args: argparse.Namespace
) -> list[str]:
    """Table rows of one case on the trace of `args.seed`."""
    case = measure_case(model, pressure, sessions, replicas, args, args.seed)
    rows = []
    for name, result in case.routers.items():
        if name.startswith("placement"):
            continue
        error = _prediction_error(result) if result.prediction_pairs else "-"
        pulls = f"{result.num_pulls} / {result.pulled_tokens}" if name == PULL else "-"
        rows.append(
            f"| {model} | {pressure} | {sessions} | {replicas} | {name} | {result.hit_rate:.1%} | "
            f"{case.ratio(result):.2f} | "
            f"{_imbalance(result.routed):.2f} | {_imbalance(result.computed):.2f} | {error} | "
            f"{pulls} |"
        )
    return rows


def measure_seeds(
    model: str, pressure: str, sessions: int, replicas: int, args: argparse.Namespace
) -> str:
    """One row over `args.seeds` traces: per router the median and the lowest hit ratio; for
    ours the traces meeting every goal, the worst token imbalance and prediction error; for
    the random fixed placements the spread of their hit ratios."""
    seeds = range(args.seed, args.seed + args.seeds)
    cases = [measure_case(model, pressure, sessions, replicas, args, seed) for seed in seeds]
    cells = []
    for name in ("round-robin", "ray-prefix-affinity", "hybrid-prefix (ours)", PULL):
        ratios = sorted(case.ratio(case.routers[name]) for case in cases)
        cells.append(f"{statistics.median(ratios):.2f} / {ratios[0]:.2f}")
    pulls = [case.routers[PULL] for case in cases]
    pull_met = sum(
        case.ratio(result) >= HIT_GOAL and _imbalance(result.computed) <= LOAD_GOAL
        for case, result in zip(cases, pulls, strict=True)
    )
    pull_tokens = max(_imbalance(result.computed) for result in pulls)
    ours = [case.routers["hybrid-prefix (ours)"] for case in cases]
    met = sum(
        case.ratio(result) >= HIT_GOAL
        and max(_imbalance(result.routed), _imbalance(result.computed)) <= LOAD_GOAL
        and _total_error(result) <= ERROR_GOAL
        for case, result in zip(cases, ours, strict=True)
    )
    tokens = max(_imbalance(result.computed) for result in ours)
    error = max(_total_error(result) for result in ours)
    placed = sorted(
        case.ratio(result)
        for case in cases
        for name, result in case.routers.items()
        if name.startswith("placement")
    )
    spread = "-"
    if placed:
        reaching = sum(ratio >= HIT_GOAL for ratio in placed) / len(placed)
        spread = (
            f"{placed[0]:.2f} / {statistics.median(placed):.2f} / {placed[-1]:.2f} "
            f"({reaching:.0%} >= {HIT_GOAL})"
        )
    return (
        f"| {model} | {pressure} | {sessions} | {replicas} | {' | '.join(cells)} | "
        f"{met}/{len(cases)} | {tokens:.2f} | {error:.1%} | {pull_met}/{len(cases)} | "
        f"{pull_tokens:.2f} | {spread} |"
    )


DRAIN_CASES = [(8, 2), (32, 4)]


def drain_rows(args: argparse.Namespace) -> list[str]:
    """Per model and case (moderate pressure): replica 0 drained a third into the run; of the
    turns that leave it, the earlier-history tokens computed again, with pulls off and on."""
    rows = []
    for model in MODELS:
        for sessions, replicas in DRAIN_CASES:
            workload = Workload(num_sessions=sessions, num_turns=args.turns, seed=args.seed)
            sched = SchedulerConfig(
                max_num_seqs=32, max_num_batched_tokens=1024, max_model_len=8192
            )
            config = model_config(model, PRESSURES["moderate"] * sessions // replicas + 1)
            plain = run(
                workload,
                config,
                sched,
                replicas,
                lambda n: HybridPrefix(n, args.delay, args.load_factor),
            )
            drain = (plain.ticks // 3, 0)
            cells = []
            for threshold in (None, args.pull_threshold):
                result = run(
                    workload,
                    config,
                    sched,
                    replicas,
                    lambda n, t=threshold: HybridPrefix(n, args.delay, args.load_factor, t),
                    drain=drain,
                )
                cells.append(result)
            off, on = cells
            ratio = on.recomputed_tokens / max(off.recomputed_tokens, 1)
            rows.append(
                f"| {model} | {sessions} | {replicas} | {drain[0]} | {off.recomputed_tokens} | "
                f"{on.recomputed_tokens} | {ratio:.1%} | {on.num_pulls} | "
                f"{off.hit_rate:.1%} / {on.hit_rate:.1%} |"
            )
    return rows


def event_overhead(args: argparse.Namespace) -> str:
    """Wall time of one replica playing a trace with KV events on (taken every step into the
    log) against off, same trace, same run."""
    workload = Workload(num_sessions=64, num_turns=args.turns, seed=args.seed)
    sched = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192)
    config = model_config("sliding+full", PRESSURES["heavy"] * 64 + 1)
    times: dict[bool, float] = {}
    for events in (False, True) * 3:
        began = time.perf_counter()
        run(workload, config, sched, 1, lambda n: RoundRobin(), events=events)
        times[events] = min(times.get(events, float("inf")), time.perf_counter() - began)
    return (
        f"KV events on one replica (64 sessions, heavy pressure, best of 3): "
        f"{times[True]:.2f} s on, {times[False]:.2f} s off ({times[True] / times[False]:.3f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two small cases only")
    parser.add_argument(
        "--delay", type=int, default=10, help="steps before events reach the router"
    )
    parser.add_argument("--load-factor", type=float, default=2.0)
    parser.add_argument(
        "--pull-threshold",
        type=int,
        default=64,
        help="tokens by which another replica's predicted hit must lead before a pull",
    )
    parser.add_argument(
        "--pull-only", action="store_true", help="only our router with pulls (and the reference)"
    )
    parser.add_argument(
        "--pressure-factor",
        type=lambda text: None if text == "off" else float(text),
        default=RoutingOptions.pressure_factor,
        help="the pull router's pool-pressure rule (RoutingOptions.pressure_factor; off: none)",
    )
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument(
        "--cases", default="", help="sessions/replicas cases, e.g. 8/2,32/4 (default: all)"
    )
    parser.add_argument("--models", default="", help="comma-separated models (default: all)")
    parser.add_argument("--pressures", default="", help="comma-separated (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=int, default=1, help="traces per case (from --seed on): a summary row each"
    )
    parser.add_argument(
        "--placements",
        type=int,
        default=0,
        help="also this many random fixed placements per trace (with --seeds > 1)",
    )
    parser.add_argument(
        "--drain", action="store_true", help="only the drained-replica run, pulls off vs on"
    )
    parser.add_argument("--serve", action="store_true", help="also the short real-Serve run")
    parser.add_argument("--serve-sessions", type=int, default=8)
    parser.add_argument("--serve-kv-bytes", type=int, default=1 << 20)
    parser.add_argument(
        "--serve-ingress",
        choices=("both", "haproxy", "proxy"),
        default="both",
        help="the HTTP ingresses of the real-Serve run (both: one Ray instance in HAProxy mode)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    if args.drain:
        print(
            "| model | sessions | replicas | drained at tick | recomputed, pull off "
            "| recomputed, pull on | on / off | pulls | hit rate off / on |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for row in drain_rows(args):
            print(row, flush=True)
        print(f"\n{time.perf_counter() - start:.0f} s")
        return
    grid = QUICK_GRID if args.quick else GRID
    if args.cases:
        grid = [tuple(map(int, case.split("/"))) for case in args.cases.split(",")]
    if args.seeds > 1 and args.pull_only:
        print_pull_seeds(args, grid)
    elif args.seeds > 1:
        print_seeds(args, grid)
    else:
        print_trace(args, grid)
    print(f"\n{time.perf_counter() - start:.0f} s")
    print(event_overhead(args))
    if args.serve:
        from routing_serve import run_serve

        both = ("haproxy", "proxy")
        ingresses = both if args.serve_ingress == "both" else (args.serve_ingress,)
        print("\n| router | ingress | sessions | turns | hit rate of later turns | wall (s) |")
        print("|---|---|---|---|---|---|")
        for row in run_serve(args.serve_sessions, 4, args.serve_kv_bytes, ingresses):
            print(row, flush=True)


def _chosen(names: str, known: Mapping[str, object]) -> list[str]:
    """The comma-separated `names` (all of `known` when empty); ValueError naming an unknown."""
    chosen = names.split(",") if names else list(known)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise ValueError(f"unknown {unknown}; known: {sorted(known)}")
    return chosen


def pull_seeds_row(
    model: str, pressure: str, sessions: int, replicas: int, args: argparse.Namespace
) -> str:
    """One row over `args.seeds` traces for the pull router alone: the hit ratio's median and
    lowest, the traces meeting the hit and token goals, the worst max/mean tokens, the pulls."""
    seeds = range(args.seed, args.seed + args.seeds)
    cases = [measure_case(model, pressure, sessions, replicas, args, seed) for seed in seeds]
    results = [case.routers[PULL] for case in cases]
    by_trace = [case.ratio(result) for case, result in zip(cases, results, strict=True)]
    tokens = [_imbalance(result.computed) for result in results]
    met = sum(
        ratio >= HIT_GOAL and token <= LOAD_GOAL
        for ratio, token in zip(by_trace, tokens, strict=True)
    )
    ratios = sorted(by_trace)
    pulls = sum(result.num_pulls for result in results)
    return (
        f"| {model} | {pressure} | {sessions} | {replicas} | {statistics.median(ratios):.2f} / "
        f"{ratios[0]:.2f} | {met}/{len(cases)} | {max(tokens):.2f} | {pulls} |"
    )


def print_pull_seeds(args: argparse.Namespace, grid: list[tuple[int, int]]) -> None:
    print(
        "| model | pool pressure | sessions | replicas | hit ratio: median / lowest "
        "| traces meeting hit and token goals | worst max/mean tokens | pulls (all traces) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model in _chosen(args.models, MODELS):
        for pressure in _chosen(args.pressures, PRESSURES):
            for sessions, replicas in grid:
                print(pull_seeds_row(model, pressure, sessions, replicas, args), flush=True)


def print_seeds(args: argparse.Namespace, grid: list[tuple[int, int]]) -> None:
    print(
        f"Over {args.seeds} traces (seeds {args.seed}..{args.seed + args.seeds - 1}); hit rate "
        "vs one replica with the whole pool, median / lowest\n"
    )
    print(
        "| model | pool pressure | sessions | replicas | round-robin | ray-prefix-affinity "
        "| hybrid-prefix (ours) | + pull | ours: traces meeting every goal "
        "| ours: worst max/mean tokens | ours: worst total error "
        "| + pull: traces meeting hit and token goals | + pull: worst max/mean tokens "
        "| random fixed placements: lowest / median / highest |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in _chosen(args.models, MODELS):
        for pressure in _chosen(args.pressures, PRESSURES):
            for sessions, replicas in grid:
                print(measure_seeds(model, pressure, sessions, replicas, args), flush=True)


def print_trace(args: argparse.Namespace, grid: list[tuple[int, int]]) -> None:
    print(
        "| model | pool pressure | sessions | replicas | router | cluster hit rate "
        "| vs one replica, whole pool | max/mean requests | max/mean tokens computed "
        "| predicted-hit error: mean / p90 / total | pulls / tokens pulled |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in _chosen(args.models, MODELS):
        for pressure in _chosen(args.pressures, PRESSURES):
            for sessions, replicas in grid:
                for row in measure(model, pressure, sessions, replicas, args):
                    print(row, flush=True)


if __name__ == "__main__":
    main()

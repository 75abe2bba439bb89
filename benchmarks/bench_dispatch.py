"""Engine -> worker ranks -> engine round trip per step, for each dispatch candidate, same run.

Each rank is a fake worker that returns at once (rank 0: one sampled token per request), so only
the dispatch is timed. The message is a realistic decode step: 256 running requests as deltas.
Candidates, for TP = 1 and TP = 2:
  - ray-call:      one actor task per rank per step, `ray.get` of the results
  - ray-cgraph:    a Ray compiled graph (shared-memory channels), `ray.get` of rank 0's ref
  - ray-conn:      Ray actors serving a direct connection each (what `RayExecutor` uses)
  - mp-pipes:      spawned processes on pipes (the multi-process executor's transport)
Then end-to-end tokens/s of the default model in-process and through the Ray engine actor, each
with synchronous steps and with async scheduling.

    python benchmarks/bench_dispatch.py [--rounds 5] [--steps 300] [--skip-e2e]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import secrets
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import ray
from serve_cpu import cpu_by_role, snapshot

from cluster.engine.executor.rank_channel import RankChannels, serve_rank
from scheduler.output import CachedRequestData, ModelRunnerOutput, SchedulerOutput

NUM_REQUESTS = 256


def decode_step(step: int = 0) -> SchedulerOutput:
    """256 decoding requests of ~500 tokens; one in 16 gets a new block this step."""
    cached = [
        CachedRequestData(
            f"req-{i}",
            num_computed_tokens=500 + step,
            new_token_ids=[(i * 31 + step) % 32000],
            new_block_ids=([1000 + i],) if (i + step) % 16 == 0 else None,
        )
        for i in range(NUM_REQUESTS)
    ]
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={c.req_id: 1 for c in cached},
        total_num_scheduled_tokens=NUM_REQUESTS,
        num_common_prefix_blocks=(0,),
        finished_req_ids=frozenset(),
    )


class FakeWorker:
    """A worker whose model step returns at once."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        if self.rank != 0:
            return None
        req_ids = list(out.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, [[7] for _ in req_ids])

    def call(self, method: str, args: tuple[object, ...]) -> object:
        return getattr(self, method)(*args)


class FakeRankActor(FakeWorker):
    """Ray actor around a fake worker: direct calls, compiled graph, or a connection loop."""

    def listen(self, authkey: bytes) -> tuple[str, int]:
        self._listener = Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
        address: tuple[str, int] = self._listener.address
        return address

    def run(self) -> None:
        with self._listener.accept() as conn:
            serve_rank(conn, self.call)


Step = Callable[[SchedulerOutput], object]


def _fake_actors(tp_size: int) -> list[Any]:
    remote = ray.remote(num_cpus=0, max_concurrency=2)(FakeRankActor)
    actors = [remote.remote(rank) for rank in range(tp_size)]
    ray.get([a.call.remote("execute", (decode_step(),)) for a in actors])
    return actors


def _kill(actors: list[Any]) -> Callable[[], None]:
    def stop() -> None:
        for actor in actors:
            ray.kill(actor)

    return stop


def setup_ray_call(tp_size: int) -> tuple[Step, Callable[[], None]]:
    actors = _fake_actors(tp_size)
    return (lambda out: ray.get([a.execute.remote(out) for a in actors])[0]), _kill(actors)


def setup_ray_cgraph(tp_size: int) -> tuple[Step, Callable[[], None]]:
    from ray.dag import InputNode, MultiOutputNode

    actors = _fake_actors(tp_size)
    with InputNode() as inp:
        dag = MultiOutputNode([a.execute.bind(inp) for a in actors])
    compiled = dag.experimental_compile()

    def stop() -> None:
        compiled.teardown()
        _kill(actors)()

    return (lambda out: ray.get(compiled.execute(out))[0]), stop


def setup_ray_conn(tp_size: int) -> tuple[Step, Callable[[], None]]:
    actors = _fake_actors(tp_size)
    authkey = secrets.token_bytes(32)
    addresses = ray.get([a.listen.remote(authkey) for a in actors])
    loops = [a.run.remote() for a in actors]
    channels = RankChannels([Client(addr, authkey=authkey) for addr in addresses], lambda: None)

    def stop() -> None:
        channels.close()
        ray.get(loops)
        _kill(actors)()

    return (lambda out: channels.call("execute", (out,), 60.0)[0]), stop


def _pipe_rank(rank: int, conn: Connection) -> None:
    serve_rank(conn, FakeWorker(rank).call)


def setup_mp_pipes(tp_size: int) -> tuple[Step, Callable[[], None]]:
    context = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(tp_size):
        parent, child = context.Pipe()
        proc = context.Process(target=_pipe_rank, args=(rank, child), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    channels = RankChannels(conns, lambda: None)

    def stop() -> None:
        channels.close()
        for proc in procs:
            proc.join(10)

    return (lambda out: channels.call("execute", (out,), 60.0)[0]), stop


def measure_dispatch(rounds: int, steps: int) -> dict[tuple[str, int], float]:
    """Median µs per step of every (candidate, TP size); rounds interleave the candidates so
    that load from other processes hits them alike (median over rounds of per-round medians)."""
    setups = {(name, tp): CANDIDATES[name](tp) for name in CANDIDATES for tp in (1, 2)}
    out = decode_step()
    per_round: dict[tuple[str, int], list[float]] = {key: [] for key in setups}
    try:
        for _ in range(rounds):
            for key, (step, _stop) in setups.items():
                for _ in range(max(10, steps // 10)):
                    step(out)
                samples = []
                for _ in range(steps):
                    start = time.perf_counter()
                    step(out)
                    samples.append(time.perf_counter() - start)
                per_round[key].append(statistics.median(samples) * 1e6)
    finally:
        for _step, stop in setups.values():
            stop()
    return {key: statistics.median(values) for key, values in per_round.items()}


ENGINES = ("in-process", "in-process async", "ray", "ray async")
"""The end-to-end engines: in-process or the Ray engine actor, synchronous or async steps."""


def bench_e2e(
    num_prompts: int, max_tokens: int, threads: int, rounds: int = 1
) -> dict[str, list[float]]:
    """Tokens/s of the default model on each of `ENGINES`, greedy, same prompts; on CPU each
    runs torch on `threads` threads (the rank actor gets a bundle of that many CPUs). All
    engines live through `rounds` rounds that run each once in turn; every run's figure."""
    import torch

    from cluster.config.engine_args import EngineArgs
    from cluster.engine.client import collect
    from cluster.engine.executor.placement import PlacementSpec
    from cluster.engine.local import InProcessEngineClient
    from cluster.engine.ray_client import RayEngineClient
    from cluster.engine.request import EngineRequest
    from scheduler.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    counter = iter(range(1 << 30))

    cpu: dict[str, dict[str, float]] = {name: {} for name in ENGINES}

    def tokens_per_s(client: Any, name: str) -> float:
        tag = next(counter)
        requests = [
            EngineRequest(f"{tag}-{i}", tuple(range(1 + i, 33 + i)), params)
            for i in range(num_prompts)
        ]
        collect(client.add_request(EngineRequest(f"warm-{tag}", (1, 2, 3), params)))
        before, start = snapshot(), time.perf_counter()
        streams = [client.add_request(request) for request in requests]
        total = sum(len(collect(s).outputs[0].token_ids) for s in streams)
        elapsed = time.perf_counter() - start
        for role, seconds in cpu_by_role(before, snapshot()).items():  # CPU ms per token
            cpu[name][role] = cpu[name].get(role, 0.0) + 1000 * seconds / total / rounds
        return total / elapsed

    def args(**kwargs: Any) -> EngineArgs:
        return EngineArgs(
            enable_prefix_caching=False,
            max_model_len=1024,
            kv_cache_memory_bytes=256 << 20,
            **kwargs,
        )

    torch.set_num_threads(threads)
    placement = PlacementSpec(({"CPU": float(threads)},))
    clients = {
        "in-process": InProcessEngineClient.from_engine_args(
            args(distributed_executor_backend="uni", async_scheduling=False)
        ),
        "in-process async": InProcessEngineClient.from_engine_args(
            args(distributed_executor_backend="uni", async_scheduling=True)
        ),
        "ray": RayEngineClient.start(args(async_scheduling=False), placement=placement),
        "ray async": RayEngineClient.start(args(async_scheduling=True), placement=placement),
    }
    runs: dict[str, list[float]] = {name: [] for name in ENGINES}
    try:
        for _ in range(rounds):
            for name in ENGINES:
                runs[name].append(tokens_per_s(clients[name], name))
            row = " / ".join(f"{runs[name][-1]:.1f}" for name in ENGINES)
            print(f"e2e round ({' / '.join(ENGINES)}): {row} tok/s", flush=True)
    finally:
        for client in clients.values():
            client.shutdown()
    for name in ENGINES:
        spent = ", ".join(f"{role} {ms:.2f}" for role, ms in cpu[name].items() if ms >= 0.01)
        print(f"CPU ms per output token, {name}: {spent}", flush=True)
    return runs


CANDIDATES: dict[str, Callable[[int], tuple[Step, Callable[[], None]]]] = {
    "ray-call (actor task per rank + ray.get)": setup_ray_call,
    "ray-cgraph (compiled graph)": setup_ray_cgraph,
    "ray-conn (actor loop on a connection; RayExecutor)": setup_ray_conn,
    "mp-pipes (spawned processes, pipes)": setup_mp_pipes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--e2e-only", action="store_true", help="skip the dispatch candidates")
    parser.add_argument("--e2e-rounds", type=int, default=1, help="alternating end-to-end runs")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-cpus", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per engine")
    opts = parser.parse_args()
    ray.init(
        address="local",
        _node_ip_address="127.0.0.2",
        num_cpus=opts.num_cpus,
        object_store_memory=200_000_000,
        include_dashboard=False,
        log_to_driver=False,
    )
    import pickle

    if not opts.e2e_only:
        print(f"decode SchedulerOutput: {len(pickle.dumps(decode_step()))} bytes pickled")
        print("| candidate | TP=1 µs/step | TP=2 µs/step |")
        print("|---|---|---|")
        results = measure_dispatch(opts.rounds, opts.steps)
        for name in CANDIDATES:
            print(f"| {name} | {results[name, 1]:.0f} | {results[name, 2]:.0f} |", flush=True)
    if not opts.skip_e2e:
        runs = bench_e2e(opts.num_prompts, opts.max_tokens, opts.threads, opts.e2e_rounds)
        base = runs["in-process"]
        print(f"default model, {opts.num_prompts} prompts x {opts.max_tokens} tokens (tok/s):")
        print("| engine | median tok/s | median of per-round ratios to in-process |")
        print("|---|---:|---:|")
        for name in ENGINES:
            ratio = statistics.median(r / b for r, b in zip(runs[name], base, strict=True))
            print(f"| {name} | {statistics.median(runs[name]):.1f} | {ratio:.2f}x |")
    ray.shutdown()


if __name__ == "__main__":
    main()

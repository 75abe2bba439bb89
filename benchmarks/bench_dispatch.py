"""Engine -> worker ranks -> engine round trip per step, for each dispatch candidate, same run.

Each rank is a fake worker that returns at once (rank 0: one sampled token per request), so only
the dispatch is timed. The message is a realistic decode step: 256 running requests as deltas.
Candidates, for TP = 1 and TP = 2:
  - ray-call:      one actor task per rank per step, `ray.get` of the results
  - ray-cgraph:    a Ray compiled graph (shared-memory channels), `ray.get` of rank 0's ref
  - ray-conn:      Ray actors serving a direct connection each (what `RayExecutor` uses)
  - mp-pipes:      spawned processes on pipes (the multi-process executor's transport)
Then end-to-end tokens/s of the default model through the Ray engine actor vs in-process.

    python benchmarks/bench_dispatch.py [--steps 2000] [--skip-e2e]
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

from cluster.engine.rank_channel import RankChannels, serve_rank
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


def _time_steps(step: Callable[[SchedulerOutput], object], steps: int) -> float:
    """Median µs per step after a warm-up."""
    out = decode_step()
    for _ in range(max(20, steps // 10)):
        step(out)
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        step(out)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def _actors(tp_size: int) -> list[Any]:
    remote = ray.remote(num_cpus=0, max_concurrency=2)(FakeRankActor)
    actors = [remote.remote(rank) for rank in range(tp_size)]
    ray.get([a.call.remote("execute", (decode_step(),)) for a in actors])
    return actors


def bench_ray_call(tp_size: int, steps: int) -> float:
    actors = _actors(tp_size)
    result = _time_steps(lambda out: ray.get([a.execute.remote(out) for a in actors])[0], steps)
    for actor in actors:
        ray.kill(actor)
    return result


def bench_ray_cgraph(tp_size: int, steps: int) -> float:
    from ray.dag import InputNode, MultiOutputNode

    actors = _actors(tp_size)
    with InputNode() as inp:
        dag = MultiOutputNode([a.execute.bind(inp) for a in actors])
    compiled = dag.experimental_compile()
    try:
        return _time_steps(lambda out: ray.get(compiled.execute(out))[0], steps)
    finally:
        compiled.teardown()
        for actor in actors:
            ray.kill(actor)


def bench_ray_conn(tp_size: int, steps: int) -> float:
    actors = _actors(tp_size)
    authkey = secrets.token_bytes(32)
    addresses = ray.get([a.listen.remote(authkey) for a in actors])
    loops = [a.run.remote() for a in actors]
    channels = RankChannels([Client(addr, authkey=authkey) for addr in addresses], lambda: None)
    try:
        return _time_steps(lambda out: channels.call("execute", (out,), 60.0)[0], steps)
    finally:
        channels.close()
        ray.get(loops)
        for actor in actors:
            ray.kill(actor)


def _pipe_rank(rank: int, conn: Connection) -> None:
    serve_rank(conn, FakeWorker(rank).call)


def bench_mp_pipes(tp_size: int, steps: int) -> float:
    context = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(tp_size):
        parent, child = context.Pipe()
        proc = context.Process(target=_pipe_rank, args=(rank, child), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    channels = RankChannels(conns, lambda: None)
    try:
        return _time_steps(lambda out: channels.call("execute", (out,), 60.0)[0], steps)
    finally:
        channels.close()
        for proc in procs:
            proc.join(10)


def bench_e2e(num_prompts: int, max_tokens: int) -> tuple[float, float]:
    """Tokens/s of the default model: (in-process, Ray engine actor), greedy, same prompts."""
    import torch

    from cluster.engine.client import collect
    from cluster.engine.local import InProcessEngineClient
    from cluster.engine.placement import PlacementSpec
    from cluster.engine.ray_client import RayEngineClient
    from cluster.engine.request import EngineRequest
    from cluster.engine_args import EngineArgs
    from scheduler.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [
        EngineRequest(str(i), tuple(range(1 + i, 33 + i)), params) for i in range(num_prompts)
    ]

    def tokens_per_s(client: Any) -> float:
        collect(client.add_request(EngineRequest("warm", (1, 2, 3), params)))
        start = time.perf_counter()
        streams = [client.add_request(request) for request in requests]
        total = sum(len(collect(s).outputs[0].token_ids) for s in streams)
        return total / (time.perf_counter() - start)

    local = InProcessEngineClient.from_engine_args(EngineArgs(distributed_executor_backend="uni"))
    try:
        in_process = tokens_per_s(local)
    finally:
        local.shutdown()
    threads = torch.get_num_threads()  # the rank gets as many CPU threads as in-process had
    placement = PlacementSpec(({"CPU": float(threads)},))
    remote = RayEngineClient.start(EngineArgs(), placement=placement)
    try:
        on_ray = tokens_per_s(remote)
    finally:
        remote.shutdown()
    return in_process, on_ray


CANDIDATES: dict[str, Callable[[int, int], float]] = {
    "ray-call (actor task per rank + ray.get)": bench_ray_call,
    "ray-cgraph (compiled graph)": bench_ray_cgraph,
    "ray-conn (actor loop on a connection; RayExecutor)": bench_ray_conn,
    "mp-pipes (spawned processes, pipes)": bench_mp_pipes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-cpus", type=int, default=4)
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

    print(f"decode SchedulerOutput: {len(pickle.dumps(decode_step()))} bytes pickled")
    print("| candidate | TP=1 µs/step | TP=2 µs/step |")
    print("|---|---|---|")
    for name, bench in CANDIDATES.items():
        cells = []
        for tp_size in (1, 2):
            try:
                cells.append(f"{bench(tp_size, opts.steps):.0f}")
            except Exception as exc:
                cells.append(f"failed: {type(exc).__name__}")
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)
    if not opts.skip_e2e:
        in_process, on_ray = bench_e2e(opts.num_prompts, opts.max_tokens)
        print(
            f"default model, {opts.num_prompts} prompts x {opts.max_tokens} tokens: "
            f"in-process {in_process:.1f} tok/s, Ray engine actor {on_ray:.1f} tok/s "
            f"({on_ray / in_process:.2f}x)"
        )
    ray.shutdown()


if __name__ == "__main__":
    main()

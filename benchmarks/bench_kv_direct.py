"""KV transfers between two engine actors on local Ray: pages over a direct connection between
the sending and the receiving rank against Ray's object store, in the same run, by size.

Three engine actors of one random Llama-shaped model (fp32, CPU; 8 layers of 8 KV heads of 64:
32 KiB of KV per token): a sender per transport (`kv_transfer_transport` object_store and
direct) and one receiver. Each pull moves a fresh prompt's prefix (computed on the sender
first, outside the timing) into the receiver (`pull_prefix`: held keys, export, pages, import);
the two transports alternate, each size starts with one pull per transport left out (the first
copies of a size fault their memory in), and reports the median of `--repeats` pulls. The
engine actors run their rank in a worker actor (as every engine actor does): through the object
store the pages also go from the sender's rank to its engine and from the receiver's engine to
its rank over the rank channels; directly, rank to rank.

    python benchmarks/bench_kv_direct.py [--lengths 32,128,512,2048] [--repeats 7] [--wire-only]

`--wire-only` leaves the engines out: two plain actors, one holding one rank's pages (16 fp32
tensors, as the model's layers give), the other taking them, through the object store (returned
and passed on) or over the direct connection (`worker.kv_io.kv_direct.offer_shard` and
`fetch_shard`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
import torch

from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.kv_transfer_ray import pull_prefix
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from cluster.ray_cluster import node_address
from scheduler.request import SamplingParams
from tests.helpers.tiny_models import save_tiny_model
from worker.kv_io.block_export import BlockPages
from worker.kv_io.kv_direct import ShardOffer, fetch_shard, offer_shard
from worker.kv_io.kv_transfer import KVShard

MODEL = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "hidden_size": 512,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 4
BLOCK_SIZE = 16
ENGINE = {
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    "max_model_len": 4096,
    "max_num_batched_tokens": 2048,
    "kv_cache_memory_bytes": 1 << 30,
}
TRANSPORTS = ("object_store", "direct")


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 1 for i in range(length)]


def _prefill(client: RayEngineClient, prompt: list[int]) -> None:
    request = EngineRequest(
        f"p{time.monotonic_ns()}", tuple(prompt[:-1]), SamplingParams(max_tokens=1)
    )
    collect(client.add_request(request))


def _start(path: Path, transport: str) -> RayEngineClient:
    args = EngineArgs(model=str(path), **ENGINE, kv_transfer_transport=transport)  # type: ignore[arg-type]
    return RayEngineClient.start(args, placement=PlacementSpec(({"CPU": 0.1},)))


@ray.remote(num_cpus=0)
class _PageHolder:
    """Holds one rank's pages of `length` tokens (the sender), or takes them (the receiver)."""

    def hold(self, length: int) -> None:
        tokens = (length - 1) // BLOCK_SIZE * BLOCK_SIZE
        layers = tuple(torch.randn(tokens, 8, 64) for _ in range(16))
        self.shard = KVShard(0, (BlockPages(0, 1, layers),))

    def pages(self) -> KVShard:
        return self.shard

    def offer(self) -> ShardOffer:
        return offer_shard(self.shard, node_address(), 60.0)

    def take(self, shard: KVShard) -> int:
        return shard.nbytes

    def fetch(self, offer: ShardOffer) -> int:
        return fetch_shard(offer, 60.0).nbytes


def _median_ms(
    repeats: int, move: Callable[[str, Any], None], prepare: Callable[[str], Any] = str
) -> tuple[float, float]:
    """(object store, direct) median milliseconds of `move(transport, prepare(transport))`
    (`prepare` untimed), the transports alternating, one move of each left out first."""
    seconds: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    for repeat in range(repeats + 1):
        for transport in TRANSPORTS:
            prepared = prepare(transport)
            started = time.perf_counter()
            move(transport, prepared)
            if repeat > 0:
                seconds[transport].append(time.perf_counter() - started)
    store, wire = (statistics.median(seconds[t]) * 1e3 for t in TRANSPORTS)
    return store, wire


def _row(length: int, num_bytes: int, engines: str, store: float, wire: float) -> str:
    return (
        f"| {length} | {num_bytes / 2**20:.2f} MiB | {engines} | {store:.1f} | {wire:.1f} | "
        f"{wire / store:.2f}x |"
    )


def _wire_only(lengths: list[int], repeats: int) -> None:
    sender, receiver = _PageHolder.remote(), _PageHolder.remote()  # type: ignore[attr-defined]

    def move(transport: str, _: object) -> None:
        if transport == "direct":
            ray.get(receiver.fetch.remote(sender.offer.remote()))
        else:
            ray.get(receiver.take.remote(sender.pages.remote()))

    for length in lengths:
        ray.get(sender.hold.remote(length))
        num_bytes = ray.get(receiver.take.remote(sender.pages.remote()))
        print(_row(length, num_bytes, "wire only", *_median_ms(repeats, move)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32,128,512,2048", help="prompt tokens per pull")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--wire-only", action="store_true", help="pages between plain actors")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    ray.init(address="local", _node_ip_address="127.0.0.2", include_dashboard=False)
    print("| prompt tokens | KV sent | engines | object store ms | direct ms | direct / store |")
    print("|---|---|---|---|---|---|")
    if args.wire_only:
        _wire_only(lengths, args.repeats)
        ray.shutdown()
        return
    path = Path(tempfile.mkdtemp(prefix="bench-kv-direct-"))
    save_tiny_model("llama", path, **MODEL)
    senders = {transport: _start(path, transport) for transport in TRANSPORTS}
    receiver = _start(path, "object_store")
    seeds = iter(range(1, 1 << 30))
    try:
        for length in lengths:

            def prefilled(transport: str, length: int = length) -> list[int]:
                prompt = _prompt(next(seeds), length)
                _prefill(senders[transport], prompt)
                return prompt

            def move(transport: str, prompt: list[int]) -> None:
                pull_prefix(senders[transport].actor, receiver.actor, prompt, timeout_s=60)

            sent = (length - 1) // BLOCK_SIZE * BLOCK_SIZE * KV_BYTES_PER_TOKEN
            medians = _median_ms(args.repeats, move, prefilled)
            print(_row(length, sent, "engine actors", *medians))
    finally:
        for client in (*senders.values(), receiver):
            client.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

"""KV transfers between two engine actors on local Ray: pages over a direct connection between
the engines' processes against Ray's object store, in the same run, by transfer size.

Three engine actors of one random Llama-shaped model (fp32, CPU; 8 layers of 8 KV heads of 64:
16 KiB of KV per token): a sender per transport (`kv_transfer_transport` object_store and
direct) and one receiver. Each pull moves a fresh prompt's prefix (computed on the sender
first, outside the timing) into the receiver (`pull_prefix`: held keys, export, pages, import);
the two transports alternate, each size starts with one pull per transport left out (the first
copies of a size fault their memory in), and reports the median of `--repeats` pulls. The
engines run the default executor on Ray (a worker actor per rank), so the pages also go from
the sender's rank to its engine and from the receiver's engine to its rank through Ray, on both
transports; `--executor uni` runs each rank in its engine's process, leaving only the hop
between the engines.

    python benchmarks/bench_kv_direct.py [--lengths 32,128,512,2048] [--repeats 7] [--executor uni]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray

from cluster.config.engine_args import EngineArgs
from cluster.engine.client import collect
from cluster.engine.executor.placement import PlacementSpec
from cluster.engine.kv_transfer_ray import pull_prefix
from cluster.engine.ray_client import RayEngineClient
from cluster.engine.request import EngineRequest
from scheduler.request import SamplingParams
from tests.helpers.tiny_models import save_tiny_model

MODEL = {
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "hidden_size": 512,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 4
ENGINE = {
    "dtype": "float32",
    "block_size": 16,
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


def _start(path: Path, transport: str, executor: str | None) -> RayEngineClient:
    engine = {
        **ENGINE,
        "kv_transfer_transport": transport,
        "distributed_executor_backend": executor,
    }
    args = EngineArgs(model=str(path), **engine)  # type: ignore[arg-type]
    return RayEngineClient.start(args, placement=PlacementSpec(({"CPU": 0.1},)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="32,128,512,2048", help="prompt tokens per pull")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--executor", choices=["ray", "uni"], default=None, help="default: ray")
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp(prefix="bench-kv-direct-"))
    save_tiny_model("llama", path, **MODEL)
    ray.init(address="local", _node_ip_address="127.0.0.2", include_dashboard=False)
    senders = {transport: _start(path, transport, args.executor) for transport in TRANSPORTS}
    receiver = _start(path, "object_store", args.executor)
    seed = 0
    print("| prompt tokens | KV sent | object store ms | direct ms | direct / object store |")
    print("|---|---|---|---|---|")
    try:
        for length in (int(n) for n in args.lengths.split(",")):
            seconds: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
            for repeat in range(args.repeats + 1):
                for transport, sender in senders.items():
                    seed += 1
                    prompt = _prompt(seed, length)
                    _prefill(sender, prompt)
                    started = time.perf_counter()
                    pull_prefix(sender.actor, receiver.actor, prompt, timeout_s=60)
                    if repeat > 0:
                        seconds[transport].append(time.perf_counter() - started)
            store, direct = (statistics.median(seconds[t]) for t in TRANSPORTS)
            sent = (length - 1) // ENGINE["block_size"] * ENGINE["block_size"] * KV_BYTES_PER_TOKEN
            print(
                f"| {length} | {sent / 2**20:.2f} MiB | {store * 1e3:.1f} | {direct * 1e3:.1f} | "
                f"{direct / store:.2f}x |"
            )
    finally:
        for client in (*senders.values(), receiver):
            client.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()

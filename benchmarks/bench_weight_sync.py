"""Weight sync against a fresh load: how long new weights take to reach a running engine, per
backend and model size, next to starting a fresh `LLM` on the same weights (goal: sync <= 0.5x).

Models: Qwen3.5-shaped hybrids (gated DeltaNet and full attention, random weights) of growing
width, saved as checkpoints. Backends, each timed from `start_weight_update` to the end of
`finish_weight_update` (the engine serving the new weights):

  memory      a sender in the engine's process (`local_rank_shards`): plan, check, copy
  checkpoint  `update_weights({"weights_path": folder})`: each rank reads its shard from disk
  ray         a trainer Ray actor (`WeightSender`), every rank fetching its own shard (--ray)
  gloo        a trainer Ray actor in a gloo group with the ranks (`CollectiveWeightSender`),
              every rank receiving its own shard point to point (--ray)

    .venv/bin/python -m benchmarks.bench_weight_sync                 # CPU, fp32
    .venv/bin/python -m benchmarks.bench_weight_sync --ray --hidden 256 512
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file

from cluster import LLM
from cluster.engine.weight_transfer import local_rank_shards, shapes_of

ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "kv_cache_memory_bytes": 1 << 24,
    "distributed_executor_backend": "uni",
}


def save_model(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Qwen3.5-shaped checkpoint; its parameter count."""
    heads = max(2, hidden // 64)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3_5ForCausalLM(config).float()
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def timed(action: Callable[[], object], repeats: int) -> float:
    """Median seconds of `action` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sync_memory(llm: LLM, tensors: dict[str, torch.Tensor]) -> None:
    plans = llm.weight_shard_plans(shapes_of(tensors))
    llm.start_weight_update()
    llm.update_weights({"shards": local_rank_shards(tensors, plans)})
    llm.finish_weight_update()


def sync_checkpoint(llm: LLM, folder: Path) -> None:
    llm.start_weight_update()
    llm.update_weights({"weights_path": str(folder)})
    llm.finish_weight_update()


def sync_ray(llm: LLM, trainer: Any) -> None:
    import ray

    plans = llm.weight_shard_plans(ray.get(trainer.shapes.remote()))
    llm.start_weight_update()
    llm.update_weights({"shards": ray.get(trainer.push.remote(plans))})
    llm.finish_weight_update()


def file_sender(base: type) -> type:
    """A trainer class on `base` (a weight sender) holding a checkpoint file's tensors."""

    class FileSender(base):  # type: ignore[valid-type,misc]
        def __init__(self, path: str) -> None:
            self.tensors = load_file(path)

        def shapes(self) -> dict[str, Any]:
            return shapes_of(self.tensors)

        def push(self, plans: list[dict[str, Any]]) -> Any:
            return self.send_weights(self.tensors, plans)

    return FileSender


def ray_trainer(folder: Path) -> Any:
    import ray

    from cluster.engine.weight_transfer import WeightSender

    actor_class: Any = ray.remote(num_cpus=0)(file_sender(WeightSender))
    trainer = actor_class.remote(str(folder / "model.safetensors"))
    ray.get(trainer.shapes.remote())  # started (the trainer's start-up is not the sync's)
    return trainer


def sync_gloo(llm: LLM, trainer: Any) -> None:
    import ray

    plans = llm.weight_shard_plans(ray.get(trainer.shapes.remote()))
    llm.start_weight_update()
    llm.update_weights({"shards": ray.get(trainer.push.remote(plans))})
    llm.finish_weight_update()
    ray.get(trainer.wait_weights_sent.remote())


def gloo_trainer(folder: Path, llm: LLM) -> Any:
    """A trainer actor in a gloo weight-transfer group with the engine's rank."""
    import ray

    from cluster.engine.weight_collective import CollectiveWeightSender

    actor_class: Any = ray.remote(num_cpus=0)(file_sender(CollectiveWeightSender))
    trainer = actor_class.remote(str(folder / "model.safetensors"))
    info = ray.get(trainer.weight_group_address.remote(world_size=2, backend="gloo"))
    joined = trainer.join_weight_transfer_group.remote(info)
    llm.init_weight_transfer_engine(info)
    ray.get(joined)
    return trainer


def measure(hidden: int, layers: int, vocab: int, repeats: int, use_ray: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-weight-sync-"))
    params = save_model(root / "model", hidden, layers, vocab)
    fresh = timed(lambda: LLM(str(root / "model"), **ENGINE_ARGS).shutdown(), repeats)
    llm = LLM(str(root / "model"), **ENGINE_ARGS)
    tensors = load_file(str(root / "model" / "model.safetensors"))
    row = {"params_m": params / 1e6, "fresh_s": fresh}
    row["memory_s"] = timed(lambda: sync_memory(llm, tensors), repeats)
    row["checkpoint_s"] = timed(lambda: sync_checkpoint(llm, root / "model"), repeats)
    if use_ray:
        trainer = ray_trainer(root / "model")
        row["ray_s"] = timed(lambda: sync_ray(llm, trainer), repeats)
        group_trainer = gloo_trainer(root / "model", llm)
        row["gloo_s"] = timed(lambda: sync_gloo(llm, group_trainer), repeats)
    llm.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray", action="store_true", help="also the trainer-actor backends")
    args = parser.parse_args()
    if args.ray:
        import ray

        # a local instance of its own (never one another program started on this machine)
        ray.init(
            address="local",
            _node_ip_address="127.0.0.2",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
        )
    backends = ["memory", "checkpoint"] + (["ray", "gloo"] if args.ray else [])
    print("params  fresh LLM  " + "  ".join(f"{b:>16}" for b in backends))
    for hidden in args.hidden:
        row = measure(hidden, args.layers, args.vocab, args.repeats, args.ray)
        cells = [f"{row[f'{b}_s']:6.3f}s ({row[f'{b}_s'] / row['fresh_s']:.2f}x)" for b in backends]
        print(f"{row['params_m']:5.1f}M  {row['fresh_s']:8.3f}s  " + "  ".join(cells))


if __name__ == "__main__":
    main()

"""One tensor-parallel rank, run in a spawned process by the TP tests.

It joins a gloo group, builds each model shard from a checkpoint through lazy safetensors reads
(recording how many elements each checkpoint tensor gave), runs one prefill through the paged
cache and saves logits, parameter shapes and read counts for the parent test to compare.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tests.helpers.paged_driver import PagedDriver
from worker.config import ModelConfig, ParallelConfig
from worker.distributed import destroy_distributed, init_distributed, tp_rank, tp_size
from worker.layers.loading import LazyWeight
from worker.models.registry import get_model_class
from worker.weights import iterate_weights


class RecordingWeight:
    """A lazy checkpoint tensor that counts the elements read from it."""

    def __init__(self, name: str, source: LazyWeight, reads: Counter[str]) -> None:
        self.name, self.source, self.reads = name, source, reads
        self.shape = source.shape

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        tensor = self.source.narrow(dim, start, length)
        self.reads[self.name] += tensor.numel()
        return tensor


def recorded(
    weights: Iterable[tuple[str, LazyWeight]], reads: Counter[str]
) -> Iterator[tuple[str, RecordingWeight]]:
    for name, source in weights:
        yield name, RecordingWeight(name, source, reads)


def _run_model(model_dir: str, parallel: ParallelConfig, prompt: list[int]) -> dict[str, object]:
    config = ModelConfig.from_pretrained(model_dir, dtype="float32")
    model = get_model_class(config.architecture)(config, parallel).eval()
    reads: Counter[str] = Counter()
    loaded = model.load_weights(recorded(iterate_weights(model_dir), reads))
    logits = PagedDriver(model).step({"req": prompt})["req"]
    return {
        "logits": logits,
        "shapes": {name: tuple(p.shape) for name, p in model.named_parameters()},
        "reads": dict(reads),
        "loaded": sorted(loaded),
    }


def run_rank(
    rank: int,
    world_size: int,
    init_method: str,
    model_dirs: list[str],
    out_dir: str,
    prompt: list[int],
) -> None:
    """Entry point of `torch.multiprocessing.spawn`; writes `out_dir/rank{rank}.pt`."""
    torch.set_num_threads(1)
    init_distributed(rank, world_size, init_method, backend="gloo")
    try:
        parallel = ParallelConfig(tp_size=world_size, rank=rank)
        results = {path: _run_model(path, parallel, prompt) for path in model_dirs}
        results["group"] = {"rank": tp_rank(), "size": tp_size()}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_distributed()

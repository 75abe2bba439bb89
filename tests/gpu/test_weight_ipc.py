"""Weights over CUDA IPC (backend "ipc"): a trainer Ray actor on the engine's GPU hands the engine
IPC handles of each rank's parts, nothing copied through the host; the engine then serves a fresh
engine's tokens and logprobs for those weights although the prompts were cached under the old."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from cluster import LLM, SamplingParams
from cluster.engine.weight_transfer import ipc_rank_shards, shapes_of
from tests.helpers.ray_local import start_local_ray, stop_local_ray
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.weight_updates import checkpoint_tensors, perturbed_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 11], [40, 2, 19, 6, 6, 23, 8, 1, 30, 12, 4]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "device": "cuda",
    "block_size": 16,
    "max_model_len": 128,
    "gpu_memory_utilization": 0.2,
    "enable_prefix_caching": True,
    "distributed_executor_backend": "uni",
    "weight_transfer_config": {"backend": "ipc"},
}


@ray.remote(num_gpus=1)
class IpcTrainer:
    """Weights on the GPU it shares with the engine (the engine runs in the driver)."""

    def __init__(self, folder: str) -> None:
        self.tensors = {n: t.cuda() for n, t in checkpoint_tensors(Path(folder)).items()}
        self.sent: Any = None

    def shapes(self) -> dict[str, Any]:
        return shapes_of(self.tensors)

    def push(self, plans: list[dict[str, Any]]) -> Any:
        self.sent = ipc_rank_shards(self.tensors, plans)  # keeps the parts alive
        return self.sent


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    result = []
    for output in llm.generate([list(p) for p in PROMPTS], PARAMS, use_tqdm=False):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        pairs = zip(tokens, completion.logprobs, strict=True)
        result.append((tokens, [entry[token].logprob for token, entry in pairs]))
    return result


def test_ipc_update_gives_a_fresh_engines_outputs(tmp_path: Path) -> None:
    save_tiny_linear_hybrid("qwen3_5", tmp_path / "old")
    perturbed_checkpoint(tmp_path / "old", tmp_path / "new", seed=2)
    fresh = LLM(str(tmp_path / "new"), **ENGINE_ARGS)
    want = _generate(fresh)
    fresh.shutdown()
    start_local_ray()
    try:
        llm = LLM(str(tmp_path / "old"), **ENGINE_ARGS)
        _generate(llm)  # cached under the old weights
        trainer = IpcTrainer.remote(str(tmp_path / "new"))
        llm.init_weight_transfer_engine()
        plans = llm.weight_shard_plans(ray.get(trainer.shapes.remote()))
        llm.start_weight_update()
        llm.update_weights({"shards": ray.get(trainer.push.remote(plans))})
        llm.finish_weight_update()
        assert _generate(llm) == want
        llm.shutdown()
    finally:
        stop_local_ray()

"""Weights pushed from a trainer Ray actor to an engine of two tensor-parallel ranks (Ray executor,
gloo): each rank fetches only its own shard from the trainer (bytes counted per rank), and
the outputs after a round trip of updates equal the fresh engine's bit for bit; a trainer killed
mid-update gives one clear error within the deadline and the engine goes on with its weights; both
ranks sleep and wake (levels 1 and 2, weights loaded while asleep) with their outputs kept. The
collective backend "gloo" (trainer and ranks in one torch.distributed group, each rank receiving
its own shard point to point) gives the outputs of the same weights loaded from their checkpoint,
and a trainer killed before its sends fails the update within the deadline."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from cluster import LLM, SamplingParams
from cluster.engine.weight_collective import CollectiveWeightSender
from cluster.engine.weight_transfer import WeightSender, shapes_of
from tests.helpers.sleep_cycles import run_cycles
from tests.helpers.tiny_linear_hybrid import save_tiny_linear_hybrid
from tests.helpers.weight_updates import checkpoint_tensors, perturbed_checkpoint
from worker.weight_group import collective_shards

pytestmark = pytest.mark.ray

PROMPTS = [[5, 17, 33, 2, 9, 41, 7, 3, 11, 8, 1], [40, 2, 19, 6, 6, 23, 8, 1, 30, 12, 4, 9, 2]]
PARAMS = SamplingParams(temperature=0, max_tokens=5, logprobs=0)
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 4,
    "max_model_len": 64,
    "kv_cache_memory_bytes": 1 << 21,
    "enable_prefix_caching": True,
    "tensor_parallel_size": 2,
    "distributed_executor_backend": "ray",
    "weight_transfer_config": {"backend": "ray", "timeout_s": 20},
}


@ray.remote(num_cpus=0)
class Trainer(WeightSender):
    """A stand-in trainer: weights under their checkpoint names, each rank's parts sent."""

    def __init__(self, folder: str) -> None:
        self.tensors = checkpoint_tensors(Path(folder))

    def shapes(self) -> dict[str, Any]:
        return shapes_of(self.tensors)

    def push(self, plans: list[dict[str, Any]]) -> Any:
        return self.send_weights(self.tensors, plans, timeout_s=20)


@ray.remote(num_cpus=0)
class GroupTrainer(CollectiveWeightSender):
    """A stand-in trainer in a gloo weight-transfer group with the engine's two ranks."""

    def __init__(self, folder: str) -> None:
        self.tensors = checkpoint_tensors(Path(folder))

    def push(self, plans: list[dict[str, Any]]) -> Any:
        return self.send_weights(self.tensors, plans)


@pytest.fixture(scope="module")
def setup(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LLM, Path, Path]]:
    root = tmp_path_factory.mktemp("tp2-weights")
    save_tiny_linear_hybrid("qwen3_5", root / "old")
    perturbed_checkpoint(root / "old", root / "new", seed=3)
    llm = LLM(str(root / "old"), **ENGINE_ARGS)
    yield llm, root / "old", root / "new"
    llm.shutdown()


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([list(p) for p in PROMPTS], PARAMS, use_tqdm=False)
    result = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        pairs = zip(tokens, completion.logprobs, strict=True)
        result.append((tokens, [entry[token].logprob for token, entry in pairs]))
    return result


def _push(llm: LLM, trainer: Any) -> list[int]:
    plans = llm.weight_shard_plans(ray.get(trainer.shapes.remote()))
    handle = ray.get(trainer.push.remote(plans))
    llm.start_weight_update()
    received = llm.update_weights({"shards": handle})
    llm.finish_weight_update()
    trainer.release_weights.remote()
    return received


def _part_bytes(plan: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    total = 0
    for name, regions in plan.items():
        tensor = tensors[name]
        for dim, _, length in regions:
            whole = tensor.numel() * tensor.element_size()
            total += whole if dim < 0 else whole // tensor.shape[dim] * length
    return total


def test_each_rank_receives_only_its_shard_and_outputs_equal_a_fresh_engine(
    setup: tuple[LLM, Path, Path],
) -> None:
    llm, old, new = setup
    before = _generate(llm)  # the fresh engine's outputs (old weights), now cached
    new_tensors = checkpoint_tensors(new)
    all_bytes = sum(t.numel() * t.element_size() for t in new_tensors.values())
    plans = llm.weight_shard_plans(shapes_of(new_tensors))
    received = _push(llm, Trainer.remote(str(new)))
    assert received == [_part_bytes(plan, new_tensors) for plan in plans]
    assert all(size < 0.75 * all_bytes for size in received), (received, all_bytes)
    assert _generate(llm) != before
    _push(llm, Trainer.remote(str(old)))
    assert llm.get_weight_version() == "2"
    assert _generate(llm) == before


def test_a_trainer_killed_mid_update_fails_it_and_the_engine_keeps_its_weights(
    setup: tuple[LLM, Path, Path],
) -> None:
    llm, _, new = setup
    llm.reset_prefix_cache()
    before, version = _generate(llm), llm.get_weight_version()
    trainer = Trainer.remote(str(new))
    plans = llm.weight_shard_plans(ray.get(trainer.shapes.remote()))
    handle = ray.get(trainer.push.remote(plans))  # the trainer holds the shards
    ray.kill(trainer, no_restart=True)
    llm.start_weight_update()
    _assert_the_lost_sender_fails_the_update(llm, handle, before, version)


def test_sleep_and_wake_of_both_ranks_with_an_update_while_asleep(
    setup: tuple[LLM, Path, Path],
) -> None:
    """Levels 1 then 2 on both rank actors; in the level-2 cycle the checkpoint's weights are
    loaded into the emptied weight memory (each rank reading its shard) before the KV cache
    wakes: every generation equals the one before the first sleep, bit for bit."""
    llm, old, _ = setup

    def update_while_asleep(engine: LLM, cycle: int) -> None:
        if cycle == 1:  # level 2: the ranks hold no weights until these arrive
            engine.start_weight_update()
            engine.update_weights({"weights_path": str(old)})
            engine.finish_weight_update()

    assert run_cycles(llm, 2, update=update_while_asleep) == 2


def _join_group(llm: LLM, trainer: Any) -> None:
    """The trainer (group rank 0) and the engine's ranks (1, 2) in one gloo group."""
    info = ray.get(trainer.weight_group_address.remote(world_size=3, timeout_s=20))
    joined = trainer.join_weight_transfer_group.remote(info)
    llm.init_weight_transfer_engine(info)
    ray.get(joined)


def test_gloo_group_update_equals_the_checkpoint_load_of_the_same_weights(
    setup: tuple[LLM, Path, Path],
) -> None:
    llm, old, new = setup
    llm.reload_weights(str(old))
    before = _generate(llm)
    trainer = GroupTrainer.remote(str(new))
    _join_group(llm, trainer)
    new_tensors = checkpoint_tensors(new)
    plans = llm.weight_shard_plans(shapes_of(new_tensors))
    handle = ray.get(trainer.push.remote(plans))
    llm.start_weight_update()
    received = llm.update_weights({"shards": handle})
    llm.finish_weight_update()
    ray.get(trainer.wait_weights_sent.remote())
    assert received == [_part_bytes(plan, new_tensors) for plan in plans]
    pushed = _generate(llm)
    llm.reload_weights(str(new))
    assert pushed == _generate(llm)
    assert pushed != before
    llm.reload_weights(str(old))


def test_gloo_trainer_killed_mid_update_fails_it_and_the_engine_keeps_its_weights(
    setup: tuple[LLM, Path, Path],
) -> None:
    llm, _, new = setup
    llm.reset_prefix_cache()
    before, version = _generate(llm), llm.get_weight_version()
    trainer = GroupTrainer.remote(str(new))
    _join_group(llm, trainer)
    new_tensors = checkpoint_tensors(new)
    handle = collective_shards(new_tensors, llm.weight_shard_plans(shapes_of(new_tensors)))
    llm.start_weight_update()
    ray.kill(trainer, no_restart=True)
    _assert_the_lost_sender_fails_the_update(llm, handle, before, version)


def _assert_the_lost_sender_fails_the_update(
    llm: LLM, handle: Any, before: list[Any], version: Any
) -> None:
    """The update with a dead sender's `handle` fails within its deadline in one line; the old
    weights (their version and outputs) stay."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"weight shard is lost \(the sender died\?\)") as err:
        llm.update_weights({"shards": handle})
    assert time.monotonic() - start < 20
    assert "\n" not in str(err.value)
    assert llm.get_weight_version() == version
    llm.reset_prefix_cache()
    assert _generate(llm) == before

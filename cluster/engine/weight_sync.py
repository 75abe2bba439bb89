"""Weights updated in place, vLLM's weight-transfer calls: the engine's side.

    init_weight_transfer_engine(init_info)   the backend (weight_transfer_config or init_info;
                                             gloo / nccl: the ranks join the trainer's group)
    weight_shard_plans(shapes)               which part of each tensor each rank reads
    start_weight_update()                    a new update: nothing staged
    update_weights(update_info)              each rank fetches and checks its shard (staged)
    finish_weight_update(weight_version)     the staged tensors into every rank's model
    get_weight_version()
    reload_weights(weights_path)             a checkpoint folder, checked, then loaded

`update_info` is `{"shards": handle}` (a sender's handle: `cluster.engine.weight_transfer`) or
`{"weights_path": folder}`. The engine serves the old weights while shards arrive; an update
whose shard is refused (unknown name, wrong shape) or lost (sender died, `timeout_s` passed)
fails with one line and leaves nothing staged: the old weights keep serving.

When new weights apply (between two steps), the weight version moves on and with it the root of
every block hash (`scheduler.weight_version`): nothing cached under the old weights is hit again,
in the device pool, the offload tier, KV transfers (the fingerprint names the version) or a
router's view (events carry the root). Requests in flight are kept: each is recomputed from its
first token under the new weights (its KV and recurrent state are rebuilt; the tokens it has
generated stay). Ranks drop their image encoder outputs. Structured-output matchers depend on
the tokenizer only and stay; LoRA adapters are deltas on top of the base weights and stay loaded
(their cached blocks move to the new root with the rest).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from cluster.config.weight_transfer import WeightTransferBackend, WeightTransferConfigArgs
from cluster.engine.outputs import RequestOutput
from scheduler.weight_version import move_to_weights_root
from worker.weight_group import COLLECTIVE_BACKENDS, WeightGroupInfo
from worker.weight_update import WeightUpdateError

if TYPE_CHECKING:
    from cluster.engine.core import EngineCore

logger = logging.getLogger(__name__)

WEIGHT_CALLS = (
    "init_weight_transfer_engine",
    "weight_shard_plans",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "get_weight_version",
    "reload_weights",
    "weight_bytes_received",
)
"""The calls every engine client forwards (`weight_call(name, *args)`)."""
ENGINE_RPC_METHODS = frozenset({"reload_weights"})
"""Worker methods that `collective_rpc` runs through the engine: they change the weights, so the
weight version (and every block-hash root) moves on with them."""


class Settled(NamedTuple):
    """A call's result, and the deltas of the step it took out of flight (to publish)."""

    value: Any
    deltas: list[RequestOutput]


@dataclass
class WeightTransferState:
    """An engine's weight-transfer set-up and the update under way."""

    config: WeightTransferConfigArgs = field(default_factory=lambda: _default_config())
    initialized: bool = False
    update_open: bool = False
    staged_folder: str | None = None
    last_sync_seconds: float = 0.0


def _default_config() -> WeightTransferConfigArgs:
    return WeightTransferConfigArgs.model_validate({})


def _state(core: EngineCore) -> WeightTransferState:
    weights = core.weights
    if weights.transfer is None:
        configured = weights.transfer_config
        assert configured is None or isinstance(configured, WeightTransferConfigArgs)
        weights.transfer = WeightTransferState(configured or _default_config())
    assert isinstance(weights.transfer, WeightTransferState)
    return weights.transfer


def _drop_update(core: EngineCore) -> None:
    """An update failed: nothing of it stays staged on any rank."""
    state = _state(core)
    state.update_open, state.staged_folder = False, None
    with contextlib.suppress(Exception):  # a dead rank: the executor's recovery handles it
        core.executor.collective_rpc("discard_staged_weights")


def init_weight_transfer_engine(core: EngineCore, init_info: dict[str, Any] | None = None) -> None:
    """Set the backend up (`init_info` may override `weight_transfer_config`'s keys)."""
    state = _state(core)
    if init_info:
        merged = {**state.config.model_dump(), **init_info}
        state.config = WeightTransferConfigArgs.model_validate(merged)
    device = core.executor.configs.runner.device
    if state.config.backend in ("ipc", "nccl") and device != "cuda":
        raise ValueError(
            f"weight_transfer_config backend {state.config.backend!r} needs the engine on CUDA"
        )
    if state.config.backend in COLLECTIVE_BACKENDS:
        info = _group_info(state.config, core.executor.configs.tensor_parallel_size)
        wait_s = state.config.timeout_s + 30  # the ranks' own join deadline comes first
        core.executor.collective_rpc("join_weight_transfer_group", info, timeout_s=wait_s)
    state.initialized = True


def _group_info(config: WeightTransferConfigArgs, tp_size: int) -> WeightGroupInfo:
    """The ranks' side of a gloo / nccl group, from the config and `init_info` (vLLM's keys)."""
    if config.master_address is None or config.master_port is None:
        raise ValueError(
            f"weight_transfer_config backend {config.backend!r}: init_weight_transfer_engine "
            "needs the trainer's master_address and master_port"
        )
    world_size = config.world_size or config.rank_offset + tp_size
    if world_size < config.rank_offset + tp_size:
        raise ValueError(
            f"world_size {world_size} has no room for this engine's {tp_size} ranks from "
            f"rank_offset {config.rank_offset}"
        )
    return WeightGroupInfo(
        config.master_address,
        config.master_port,
        world_size,
        config.rank_offset,
        config.backend,
        config.timeout_s,
    )


def backend(core: EngineCore) -> WeightTransferBackend:
    return _state(core).config.backend


def weight_shard_plans(core: EngineCore, shapes: dict[str, Any]) -> list[Any]:
    """Per rank: checkpoint name -> the (dim, start, length) parts its loaders read; the names
    and shapes checked first (WeightUpdateError naming the first bad one)."""
    return core.executor.collective_rpc("weight_shard_plan", shapes)


def start_weight_update(core: EngineCore) -> None:
    """Open an update: whatever an earlier, unfinished update staged is dropped."""
    state = _state(core)
    core.executor.collective_rpc("discard_staged_weights")
    state.update_open, state.staged_folder = True, None
    state.last_sync_seconds = 0.0


def update_weights(core: EngineCore, update_info: dict[str, Any]) -> list[int]:
    """Every rank fetches and checks its shard of `update_info["shards"]` (kept until
    `finish_weight_update`), or a folder is noted (`update_info["weights_path"]`); the bytes
    each rank received. On error the update is dropped and the old weights keep serving."""
    state = _state(core)
    if not state.update_open:
        start_weight_update(core)
    start = time.perf_counter()
    try:
        if "weights_path" in update_info:
            state.staged_folder = str(update_info["weights_path"])
            return []
        shards = update_info.get("shards")
        if shards is None or not hasattr(shards, "fetch"):
            raise WeightUpdateError(
                "update_info needs 'shards' (a sender's handle) or 'weights_path'"
            )
        received = core.executor.collective_rpc("receive_weight_shard", shards)
    except BaseException:
        _drop_update(core)
        raise
    state.last_sync_seconds += time.perf_counter() - start
    return [int(n) for n in received]  # type: ignore[call-overload]


def finish_weight_update(core: EngineCore, weight_version: str | int | None = None) -> Settled:
    """Apply the staged update on every rank, between two steps; the new version (default:
    the number of updates so far). Requests in flight are recomputed under the new weights."""
    state = _state(core)
    if not state.update_open:
        raise ValueError("finish_weight_update: no update was started (start_weight_update)")
    deltas = core.finish_in_flight()
    start = time.perf_counter()
    try:
        if state.staged_folder is not None:
            core.executor.collective_rpc("reload_weights", state.staged_folder)
        else:
            core.executor.collective_rpc("apply_staged_weights")
    finally:
        state.update_open, state.staged_folder = False, None
    state.last_sync_seconds += time.perf_counter() - start
    return Settled(_advance(core, weight_version), deltas)


def reload_weights(core: EngineCore, weights_path: str | None = None) -> Settled:
    """Load a checkpoint folder's weights in place (checked whole first; default: the model's
    own folder), as `collective_rpc("reload_weights", kwargs={"weights_path": ...})` does."""
    deltas = core.finish_in_flight()
    core.executor.collective_rpc("reload_weights", weights_path)
    return Settled(_advance(core, None), deltas)


def engine_rpc(core: EngineCore, call: Any) -> Settled:
    """`collective_rpc` of a method of `ENGINE_RPC_METHODS` (vLLM's
    `collective_rpc("reload_weights", kwargs={"weights_path": ...})`): run on every rank between
    two steps, then the new weights' version; the ranks' results."""
    deltas = core.finish_in_flight()
    results = core.executor.collective_rpc("run_rpc", call)
    _advance(core, None)
    return Settled(results, deltas)


def get_weight_version(core: EngineCore) -> str | None:
    """The version of the weights being served (None: those loaded at start-up)."""
    return core.weights.version


def weight_bytes_received(core: EngineCore) -> list[int]:
    """Bytes of weight shards each rank has received since start-up."""
    return [int(n) for n in core.executor.collective_rpc("weight_bytes_received")]  # type: ignore[call-overload]


def _advance(core: EngineCore, weight_version: str | int | None) -> str:
    """The weights changed on every rank: new version, new root, requests recomputed."""
    version = core.weights.advance(weight_version)
    recomputed = move_to_weights_root(core.scheduler, core.weights.root)
    core._record_kv_events()
    logger.info(
        "weights updated to version %s (%d requests in flight recomputed under them)",
        version,
        len(recomputed),
    )
    return version


def run_weight_call(core: EngineCore, name: str, *args: Any) -> Any:
    """`name(core, *args)` for a name of `WEIGHT_CALLS` (ValueError for any other)."""
    if name not in WEIGHT_CALLS:
        raise ValueError(f"unknown weight call {name!r}")
    return globals()[name](core, *args)

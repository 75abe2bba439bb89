"""vLLM's weight-transfer calls on every engine surface: `LLM`, the clients, the asyncio engine
and the engine actor share these signatures, and each sends the call on by its own
`weight_call(name, *args)` (the engine runs it with `cluster.engine.weight_sync`).

    llm.init_weight_transfer_engine()                      # weight_transfer_config's backend
    plans = llm.weight_shard_plans(shapes_of(state_dict))  # one per rank
    llm.start_weight_update()
    llm.update_weights({"shards": handle})                 # or {"weights_path": folder}
    llm.finish_weight_update(weight_version=7)
    llm.get_weight_version()                               # "7"

`weight_shard_plans` and `weight_bytes_received` are ours (vLLM's sharded backends plan inside
their trainer engine): a sender cuts each rank's parts by them (`cluster.engine.weight_transfer`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any


class WeightCalls:
    """The blocking weight-transfer calls; a subclass says how a call reaches its engine."""

    weight_call: Callable[..., Any]
    """`weight_call(name, *args)`: how a call reaches the engine (each subclass defines it)."""

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any] | None = None) -> None:
        """Set the transfer backend up (`init_info` may override weight_transfer_config)."""
        self.weight_call("init_weight_transfer_engine", dict(init_info or {}))

    def weight_shard_plans(self, shapes: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Per rank, the (dim, start, length) parts of each tensor it reads; `shapes` maps each
        checkpoint name to (shape, dtype) (`weight_transfer.shapes_of`). Checks the names and
        shapes (ValueError naming the first bad one)."""
        plans: list[dict[str, Any]] = self.weight_call("weight_shard_plans", dict(shapes))
        return plans

    def start_weight_update(self) -> None:
        """Begin an update (what an unfinished one staged is dropped)."""
        self.weight_call("start_weight_update")

    def update_weights(self, update_info: Mapping[str, Any]) -> list[int]:
        """Each rank fetches and checks its shard of `{"shards": handle}`, or a folder is noted
        (`{"weights_path": ...}`); the bytes each rank received. ValueError (one line) and the
        old weights kept when a name, shape or shard is wrong or lost."""
        received: list[int] = self.weight_call("update_weights", dict(update_info))
        return received

    def finish_weight_update(self, weight_version: str | int | None = None) -> str:
        """Apply the update on every rank between two steps; the new version."""
        version: str = self.weight_call("finish_weight_update", weight_version)
        return version

    def get_weight_version(self) -> str | None:
        """The version of the weights served (None: those loaded at start-up)."""
        version: str | None = self.weight_call("get_weight_version")
        return version

    def reload_weights(self, weights_path: str | None = None) -> str:
        """Load a checkpoint folder in place (checked whole first); the new version."""
        version: str = self.weight_call("reload_weights", weights_path)
        return version

    def weight_bytes_received(self) -> list[int]:
        """Bytes of weight shards each rank has received since start-up."""
        received: list[int] = self.weight_call("weight_bytes_received")
        return received


class AsyncWeightCalls:
    """The asyncio weight-transfer calls; a subclass says how a call reaches its engine."""

    weight_call: Callable[..., Awaitable[Any]]
    """`await weight_call(name, *args)`: how a call reaches the engine (each subclass defines
    it)."""

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any] | None = None) -> None:
        await self.weight_call("init_weight_transfer_engine", dict(init_info or {}))

    async def weight_shard_plans(self, shapes: Mapping[str, Any]) -> list[dict[str, Any]]:
        plans: list[dict[str, Any]] = await self.weight_call("weight_shard_plans", dict(shapes))
        return plans

    async def start_weight_update(self) -> None:
        await self.weight_call("start_weight_update")

    async def update_weights(self, update_info: Mapping[str, Any]) -> list[int]:
        received: list[int] = await self.weight_call("update_weights", dict(update_info))
        return received

    async def finish_weight_update(self, weight_version: str | int | None = None) -> str:
        version: str = await self.weight_call("finish_weight_update", weight_version)
        return version

    async def get_weight_version(self) -> str | None:
        version: str | None = await self.weight_call("get_weight_version")
        return version

    async def reload_weights(self, weights_path: str | None = None) -> str:
        version: str = await self.weight_call("reload_weights", weights_path)
        return version

    async def weight_bytes_received(self) -> list[int]:
        received: list[int] = await self.weight_call("weight_bytes_received")
        return received

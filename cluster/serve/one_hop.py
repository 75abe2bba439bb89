"""`OpenAiServer`: a model deployment that serves the OpenAI routes itself (one-hop topology).

The HTTP routes and gRPC methods of `OpenAiIngress` run inside the model's replica, which calls
its own `LLMServer` directly instead of through a deployment handle: a request crosses
proxy -> replica only, and the validated request and its chunks never leave the process.
It serves one model; the builder uses the two-deployment topology for several.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ray import serve

from cluster.config import LLMConfig
from cluster.config.lora import served_model
from cluster.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from cluster.serve import errors
from cluster.serve.ingress import OpenAiIngress, app
from cluster.serve.llm_server import LLMServer, ServerItem


class LocalItemStream:
    """The rest of an `LLMServer.generate` stream, relayed in the process that produces it;
    `cancel` closes the generator (aborting the request) without blocking the caller."""

    def __init__(
        self, items: AsyncGenerator[ServerItem, None], closing: set[asyncio.Task[None]]
    ) -> None:
        self._items = items
        self._closing = closing

    def __aiter__(self) -> LocalItemStream:
        return self

    async def __anext__(self) -> ServerItem:
        return await self._items.__anext__()

    def cancel(self) -> None:
        task = asyncio.get_running_loop().create_task(self._items.aclose())
        self._closing.add(task)  # held until done: a pending task is only weakly referenced
        task.add_done_callback(self._closing.discard)


class OpenAiServer(OpenAiIngress):
    """The OpenAI routes and the model's engine in one replica (the body of the one-hop
    deployment); also answers the `LLMServer` handle methods."""

    def __init__(self, llm_config: LLMConfig | dict[str, Any]) -> None:
        super().__init__({})
        self.server = LLMServer(llm_config)
        self._closing: set[asyncio.Task[None]] = set()

    async def start(
        self, request: CompletionRequest | ChatCompletionRequest, request_id: str, as_sse: bool
    ) -> tuple[Any, LocalItemStream | None]:
        if (
            request.model is not None
            and served_model(request.model, [self.server.model_id]) is None
        ):
            return errors.model_not_found(request.model), None
        items = self.server.generate(request, request_id, as_sse)
        try:
            first = await items.__anext__()
        except StopAsyncIteration:
            return errors.error_response("the model returned nothing", 500), None
        if isinstance(first, ErrorResponse):
            await items.aclose()
            return first, None
        return first, LocalItemStream(items, self._closing)

    async def models(self) -> ModelList:
        return ModelList(data=await self.server.model_cards())

    async def find_model_card(self, model: str) -> ModelCard | ErrorResponse:
        cards = await self.server.model_cards()
        return next((card for card in cards if card.id == model), errors.model_not_found(model))

    async def unhealthy_model(self) -> str | None:
        try:
            await self.server.check_health()
        except Exception as error:
            return f"model {self.server.model_id} is unhealthy: {error}"
        return None

    # -- the LLMServer handle methods ----------------------------------------------------------

    async def generate(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        as_sse: bool = True,
    ) -> AsyncIterator[ServerItem]:
        async for item in self.server.generate(request, request_id, as_sse):
            yield item

    async def model_card(self) -> ModelCard:
        return await self.server.model_card()

    async def model_cards(self) -> list[ModelCard]:
        return await self.server.model_cards()

    async def check_health(self) -> None:
        """Serve's health check: raises when the engine or a worker is dead."""
        await self.server.check_health()

    async def stats(self) -> dict[str, Any]:
        return await self.server.stats()

    def __del__(self) -> None:
        """Serve calls this after draining: stop the engine."""
        server = getattr(self, "server", None)
        if server is not None:
            server.__del__()


OpenAiServerDeployment = serve.ingress(app)(OpenAiServer)

__all__ = ["LocalItemStream", "OpenAiServer", "OpenAiServerDeployment"]

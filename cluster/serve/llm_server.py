"""`LLMServer`: one Serve replica of one model, and the engine of that model.

The replica builds the engine core (scheduler + hybrid KV coordinator) in its own process and
drives the model's tensor-parallel workers, which the Ray executor places in the replica's
placement group (the replica itself sits in bundle 0). It takes the ingress's validated
request models, tokenizes them, runs them on its `AsyncEngine` and yields OpenAI bodies:

    generate(request) ─► ErrorResponse | (SSE str ... "data: [DONE]") | one response body

Closing the stream (the client went away; Serve cancels the call across the hop) aborts the
request in the engine, freeing its blocks before the next step. An engine that fails under a
request (`EngineDeadError`) answers 503 in OpenAI's shape: before a stream starts as the error
response, mid-stream as a last error event (then `[DONE]`); a dead engine also fails
`check_health`, so Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cluster.config import EngineArgs, LLMConfig, resolve_executor_backend
from cluster.config.lora import HF_SCHEME, served_model
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.core import build_engine_core
from cluster.engine.errors import EngineDeadError
from cluster.engine.executor import create_executor
from cluster.engine.executor.placement import PlacementSpec, uses_gpus
from cluster.engine.input_processor import InputProcessor
from cluster.engine.kv_transfer import KVTransfer, kv_export, transfer_counters
from cluster.engine.lifecycle import CONTROL_NAMES
from cluster.engine.mm_inputs import MultiModalConfig, load_multimodal_inputs
from cluster.engine.outputs import OutputAccumulator, RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine.stream_batching import StreamBatching
from cluster.engine.weight_sync import WEIGHT_CALLS
from cluster.openai_api.content_parts import first_image_part
from cluster.openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
)
from cluster.openai_api.sampling import UnsupportedFieldError
from cluster.serve import errors
from cluster.serve.autoscaling_stats import RecentTTFT, autoscaling_stats
from cluster.serve.batch_policy import batch_scheduling_policy
from cluster.serve.completion_batch import batched_completion
from cluster.serve.drain_handoff import (
    DrainHandoff,
    HandoffPrefix,
    handoff_options,
    remembered,
)
from cluster.serve.formatting import (
    DONE,
    ChatFormatter,
    CompletionFormatter,
    response_formatter,
    sse,
)
from cluster.serve.hybrid_router import kv_events_enabled, routing_stats
from cluster.serve.lora_metrics import LoRAMetrics
from cluster.serve.metrics import EngineMetrics
from cluster.serve.peer_pull import PeerPull, pull_from_peer
from cluster.serve.transfer_metrics import TransferMetrics
from scheduler.kv_cache.transfer import HeldKeys
from scheduler.lora import LoRARequest
from worker.kv_io.kv_direct import SEND_TIMEOUT_S

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
ServerItem = ErrorResponse | str | BaseModel
Formatter = CompletionFormatter | ChatFormatter


def serving_engine_args(config: LLMConfig) -> EngineArgs:
    """The replica's engine arguments: the Ray executor unless engine_kwargs names another, and
    the priority policy unless they choose one (the app's batch lines wait behind chats)."""
    args = config.engine_args()
    backend = resolve_executor_backend(args, "serve_replica")
    update: dict[str, Any] = {"distributed_executor_backend": backend}
    if "scheduling_policy" not in config.engine_kwargs:
        update["scheduling_policy"] = batch_scheduling_policy()
    return args.model_copy(update=update)


def rank_placement(config: LLMConfig) -> PlacementSpec:
    """The ranks' own bundles: the replica's group also holds the replica in bundle 0, and a
    rank's torch threads count only its own CPUs."""
    device = config.engine_kwargs.get("device")
    bundles = config.placement_bundles(use_gpu=uses_gpus(device))
    return PlacementSpec(tuple(bundles), config.placement_strategy)


def group_kinds(engine: AsyncEngine) -> list[str]:
    """`full_attention`, `sliding_window`, ... per KV cache group."""
    return [group.spec.kind for group in engine.core.scheduler.kv_cache_config.groups]


class LLMServer:
    """The body of the `LLMServer:<model>` deployment (wrapped by `serve.deployment`)."""

    def __init__(self, llm_config: LLMConfig | dict[str, Any]) -> None:
        self.config = LLMConfig.model_validate(llm_config)
        self.model_id = self.config.model_id
        args = serving_engine_args(self.config)
        self.engine = AsyncEngine(
            build_engine_core(args, create_executor(args, rank_placement(self.config))),
            StreamBatching(self.config.stream_batching_interval_ms),
        )
        logger.info("stream batching: %s", self.engine.stream_batching.description)
        self.tokenizer = self.engine.core.tokenizer
        model = self.engine.core.model_config
        self.max_model_len = model.max_model_len
        multimodal = load_multimodal_inputs(
            model.model_path, MultiModalConfig.from_engine_args(args)
        )
        self.inputs = InputProcessor(
            self.tokenizer, model.vocab_size, model.max_model_len, self.config.model_id, multimodal
        )
        self.draining = False
        self.recent_ttft = RecentTTFT()
        self.metrics: EngineMetrics | None = None
        self._stats_task: asyncio.Task[None] | None = None
        self.transfer_metrics: TransferMetrics | None = None
        self.lora_metrics: LoRAMetrics | None = None
        if self.config.log_engine_metrics:
            self.metrics = EngineMetrics(self.model_id, group_kinds(self.engine))
            self.transfer_metrics = TransferMetrics(self.model_id, len(group_kinds(self.engine)))
            if self.config.lora_config is not None:
                self.lora_metrics = LoRAMetrics(self.model_id)
        if kv_events_enabled(self.config.deployment_config):
            self.engine.core.enable_kv_events()
        options = handoff_options(self.config.deployment_config)
        self.handoff = None if options is None else DrainHandoff(self.engine, options)

    async def generate(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        as_sse: bool = True,
        prompt_token_ids: list[int] | None = None,
        kv_source: PeerPull | None = None,
    ) -> AsyncGenerator[ServerItem, None]:
        """The request's OpenAI bodies: an error, or the stream's chunks (SSE lines ending with
        `[DONE]`, or chunk models when not `as_sse`), or one response (not `request.stream`).
        `prompt_token_ids`: the prompt as the request router tokenized it; `kv_source`: the
        peer replica the router predicts caches the prompt's prefix (pulled before the engine
        runs the request, or recomputed)."""
        self._ensure_stats_task()
        if self.draining:
            yield errors.unavailable("the server is shutting down")
            return
        if isinstance(request, CompletionRequest) and len(request.prompts) > 1:
            async for item in batched_completion(self.generate, request, request_id, as_sse):
                yield item
            return
        try:
            engine_request, formatter = await self._prepare_off_loop(
                request, request_id, prompt_token_ids
            )
            await self.before_add(engine_request)
            if kv_source is not None:
                await pull_from_peer(self.engine, engine_request, kv_source)
            stream = await self.engine.add_request(engine_request)
            stream = remembered(self.handoff, stream, engine_request)
            self._record_lora(engine_request)
        except UnsupportedFieldError as error:
            yield errors.bad_request(str(error), param=error.param)
            return
        except ValueError as error:
            yield errors.bad_request(str(error))
            return
        except EngineDeadError as error:
            yield errors.unavailable(str(error))
            return
        if request.stream:
            items = self._stream(stream, formatter, request.include_usage, as_sse)
        else:
            items = self._whole(stream, formatter)
        async for item in items:
            yield item

    async def _stream(
        self,
        stream: AsyncIterator[RequestOutput],
        formatter: Formatter,
        include_usage: bool,
        as_sse: bool,
    ) -> AsyncIterator[ServerItem]:
        accumulator = OutputAccumulator()
        try:
            async with self._tracked(stream, accumulator):
                async for delta in stream:
                    self._record_first_token(delta, accumulator)
                    accumulator.add(delta)
                    self._record_tokens(delta)
                    chunk = formatter.chunk(delta)
                    if chunk is not None:
                        yield sse(chunk) if as_sse else chunk
        except EngineDeadError as error:  # the stream has begun: its last event is the error
            failure = errors.unavailable(str(error))
            yield sse(failure) if as_sse else failure
            if as_sse:
                yield DONE
            return
        result = accumulator.result
        if include_usage and result is not None:
            tokens = sum(len(part.token_ids) for part in result.outputs)
            usage = formatter.usage_chunk(result, tokens)
            yield sse(usage) if as_sse else usage
        if as_sse:
            yield DONE

    async def _whole(
        self, stream: AsyncIterator[RequestOutput], formatter: Formatter
    ) -> AsyncIterator[ServerItem]:
        accumulator = OutputAccumulator()
        try:
            async with self._tracked(stream, accumulator):
                async for delta in stream:
                    self._record_first_token(delta, accumulator)
                    accumulator.add(delta)
                    self._record_tokens(delta)
        except EngineDeadError as error:
            yield errors.unavailable(str(error))
            return
        assert accumulator.result is not None
        yield formatter.response(accumulator.result)

    @contextlib.asynccontextmanager
    async def _tracked(
        self, stream: AsyncIterator[RequestOutput], accumulator: OutputAccumulator
    ) -> AsyncIterator[None]:
        """Close the engine stream (aborting the request) if the caller goes away."""
        try:
            yield
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
            result = accumulator.result
            if self.metrics is not None and result is not None and result.finished:
                self.metrics.record_finished(result)

    def _record_lora(self, engine_request: EngineRequest) -> None:
        lora = engine_request.lora_request
        if self.lora_metrics is None or lora is None:
            return
        load_seconds = self.engine.core.lora_load_seconds.get(lora.lora_name, 0.0)
        num_prompt = len(engine_request.prompt_token_ids)
        self.lora_metrics.record_request(lora.lora_name, num_prompt, load_seconds)

    async def kv_export(
        self,
        prompt_token_ids: list[int],
        held: HeldKeys,
        cache_salt: str | None = None,
        timeout_s: float = SEND_TIMEOUT_S,
    ) -> KVTransfer:
        """A peer's pull: the blocks of this replica's cached prefix of the prompt that the
        peer does not hold. The conversation moved to the peer, so they are evicted here first.
        Answered while Serve drains this replica too (it is called on this replica's actor, not
        routed); refused once the engine is shut down (the peer recomputes at once). Pages
        offered over a direct connection wait `timeout_s` for the peer."""
        if self.draining:
            raise RuntimeError("the replica has shut its engine down; nothing to export")
        demote = True
        return await self.engine.call_core(
            kv_export, prompt_token_ids, held, cache_salt, demote, timeout_s
        )

    async def transfer_stats(self, to_replica: str | None = None) -> dict[str, int]:
        """Requests whose prefix this replica took from another engine (P/D hand-off, pull),
        those it recomputed after a failed transfer, those waiting for theirs now, the KV blocks
        it sent and received, and its exports offered over direct connections: all of them,
        those whose pages its ranks still hold, and those dropped untaken (`to_replica` names
        this replica to the router)."""
        counters = await self.engine.call_core(transfer_counters)
        return {
            "pulls": counters.num_pulls,
            "recomputes": counters.num_recomputes,
            "pulls_in_flight": counters.num_pulls_in_flight,
            "blocks_sent": sum(counters.blocks_sent),
            "blocks_received": sum(counters.blocks_received),
            "direct_offers": counters.num_offers,
            "sends_pending": counters.num_sends_pending,
            "failed_sends": counters.num_failed_sends,
        }

    async def before_add(self, request: EngineRequest) -> None:
        """Runs before a request enters the engine (a decode replica imports its KV here)."""

    def _record_first_token(self, delta: RequestOutput, accumulator: OutputAccumulator) -> None:
        """The request's time to first token, for the autoscaler, from its first delta."""
        ttft = delta.metrics.time_to_first_token if delta.metrics is not None else None
        if accumulator.result is None and ttft is not None:
            self.recent_ttft.observe(ttft)

    def _record_tokens(self, delta: RequestOutput) -> None:
        if self.metrics is not None:
            self.metrics.record_tokens(delta)

    async def _prepare_off_loop(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        prompt_token_ids: list[int] | None,
    ) -> tuple[EngineRequest, Formatter]:
        """`_prepare`, in a thread for a request with images (fetched and processed there), so
        the other requests' streams keep flowing meanwhile."""
        if isinstance(request, ChatCompletionRequest) and first_image_part(request.messages):
            return await asyncio.to_thread(self._prepare, request, request_id)
        return self._prepare(request, request_id, prompt_token_ids)

    def _prepare(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        request_id: str,
        prompt_token_ids: list[int] | None = None,
    ) -> tuple[EngineRequest, Formatter]:
        prompt, params = self.inputs.openai(request, prompt_token_ids)
        text, token_ids = prompt.text, prompt.token_ids
        engine_request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            prompt=text,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=self._lora_request(request.model),
            mm_features=prompt.mm_features,
        )
        formatter = response_formatter(
            request, request_id, self.model_id, text, self.tokenizer, self.config.tool_call_parser
        )
        return engine_request, formatter

    async def model_card(self) -> ModelCard:
        return ModelCard(
            id=self.model_id,
            root=self.config.model_loading_config.source,
            max_model_len=self.max_model_len,
        )

    async def model_cards(self) -> list[ModelCard]:
        """The base model's card, then one per LoRA adapter it can serve: loaded ones and
        those in a local dynamic_lora_loading_path."""
        cards = [await self.model_card()]
        lora = self.config.lora_config
        if lora is None:
            return cards
        paths = {name: request.lora_path for name, request in self.engine.core.loras.items()}
        for name in sorted(set(lora.local_adapters()) | set(paths)):
            root = paths.get(name, str(Path(lora.dynamic_lora_loading_path) / name))
            cards.append(
                ModelCard(
                    id=f"{self.model_id}:{name}",
                    root=root,
                    parent=self.model_id,
                    max_model_len=self.max_model_len,
                )
            )
        return cards

    def _lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); ValueError naming it
        when this model serves no adapters or the adapter cannot be had."""
        served = served_model(model, [self.model_id]) if model is not None else None
        adapter = None if served is None else served[1]
        if adapter is None:
            return None
        lora = self.config.lora_config
        if lora is None:
            raise ValueError(f"model {self.model_id!r} serves no LoRA adapters (no lora_config)")
        known = self.engine.core.loras.get(adapter)
        if known is not None and lora.dynamic_lora_loading_path.startswith(HF_SCHEME):
            # downloaded already: no Hub round trip (under the download lock, on the event
            # loop) for each request naming it
            return known
        download_dir = self.config.engine_kwargs.get("download_dir")
        return lora.adapter_request(adapter, download_dir)

    async def accept_handoff(self, source: str, prefix: HandoffPrefix) -> bool:
        """A stopped peer replica's conversation: pull its prefix from there (`drain_handoff`)."""
        if self.handoff is None or self.draining:
            raise RuntimeError("this replica takes no hand-offs")
        return await self.handoff.accept(source, prefix)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve polls this for the request routers: KV events and usage ({} when off)."""
        return routing_stats(self.engine.core)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve polls this while the deployment autoscales: pressure per KV cache group,
        waiting requests and recent p90 TTFT (`cluster.serve.autoscaling_stats`)."""
        stats = await self.engine.get_stats()
        return autoscaling_stats(stats, group_kinds(self.engine), self.recent_ttft)

    async def control(self, name: str, *args: object) -> object:
        """An engine control call of the development routes (`cluster.serve.dev_routes`)."""
        if name not in CONTROL_NAMES:
            raise ValueError(f"unknown engine control call {name!r}")
        return await self.engine.control(name, *args)

    async def weight_call(self, name: str, *args: object) -> object:
        """A weight-transfer call of the development routes (`cluster.engine.weight_calls`)."""
        if name not in WEIGHT_CALLS:
            raise ValueError(f"unknown weight call {name!r}")
        return await self.engine.weight_call(name, *args)

    async def check_health(self) -> None:
        """Serve's health check: raises when the engine or a worker is dead."""
        await self.engine.check_health()

    async def stats(self) -> dict[str, Any]:
        """Engine state for tests and debugging: scheduler stats, steps, aborts."""
        stats = await self.engine.get_stats()
        return {
            "num_running": stats.num_running_reqs,
            "num_waiting": stats.num_waiting_reqs,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_steps": self.engine.num_steps,
            "num_in_flight": self.engine.num_in_flight,
            "num_aborted": self.engine.num_aborted,
        }

    def _ensure_stats_task(self) -> None:
        if self.metrics is not None and (self._stats_task is None or self._stats_task.done()):
            self._stats_task = asyncio.get_running_loop().create_task(self._publish_stats())

    async def _publish_stats(self) -> None:
        assert self.metrics is not None
        num_ranks = self.config.tensor_parallel_size
        while True:
            stats = await self.engine.get_stats()
            self.metrics.record_stats(stats)
            if self.transfer_metrics is not None:
                self.transfer_metrics.record(self.engine.core.kv_transfer_counters)
            if self.lora_metrics is not None:
                self.lora_metrics.record_stats(stats)
            try:
                await self.engine.check_health()
                alive = [True] * num_ranks
            except Exception:
                alive = [False] * num_ranks
            self.metrics.record_workers(alive)
            await asyncio.sleep(STATS_INTERVAL_S)

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Serve calls this after draining (graceful_shutdown_timeout_s) and awaits what it
        returns: the engine stopped, after a drain hand-off when one is due (on Serve's loop).
        Also runs for a replica whose `__init__` failed, which may lack any attribute."""
        handoff: DrainHandoff | None = getattr(self, "handoff", None)
        if handoff is not None and handoff.is_due():
            return handoff.run_then(self._stop)
        self._stop()
        return None

    def _stop(self) -> None:
        self.draining = True
        stats_task = getattr(self, "_stats_task", None)
        if stats_task is not None:
            stats_task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.core.shutdown()

"""Offline generation: `LLM(...).generate(prompts, sampling_params)`, vLLM's offline API.

`LLM` is a thin caller of an `EngineClient`: in-process by default (the engine core and its
executor live in the caller's process tree), or the Ray engine actor when `address` is given
(`"auto"`, `"local"` or `"ray://host:port"`; the cluster is found as `cluster.ray_cluster`
says). The engine stops when `shutdown()` is called, when the `LLM` is garbage-collected, or at
interpreter exit before Ray's own exit hook, so a script that never calls `shutdown()` ends.
Results come back in input order as vLLM-shaped `RequestOutput`s. A call's prompts are all
checked (`cluster.llm_inputs`, then the engine's one input processor) before any is queued, and
a failing call aborts what it queued, so an error never leaves work behind in the engine.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from cluster.config.engine_args import resolve_executor_backend, validate_engine_kwargs
from cluster.engine.client import EngineClient, EngineInfo, collect
from cluster.engine.controls import EngineControls
from cluster.engine.input_processor import ChatMessage, InputProcessor, Prompt, PromptInput
from cluster.engine.metric_reader import Metric, read_metrics
from cluster.engine.mm_inputs import MultiModalConfig, load_multimodal_inputs
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import EngineRequest
from cluster.engine.weight_calls import WeightCalls
from cluster.llm_inputs import (
    as_conversation_list,
    as_lora_list,
    as_params_list,
    as_prompt_list,
)
from scheduler.lora import LoRARequest
from scheduler.request import SamplingParams

logger = logging.getLogger(__name__)


class LLM(EngineControls, WeightCalls):
    """An offline engine for one model; keyword arguments are vLLM's engine arguments.

    vLLM's control calls (`sleep`, `wake_up`, `is_sleeping`, `pause_generation`,
    `resume_generation`, `is_paused`, `reset_prefix_cache`, `collective_rpc`) come from
    `cluster.engine.controls`, which also says where they differ from vLLM's.
    """

    def __init__(self, model: str | None = None, *, address: str | None = None, **kwargs: Any):
        args = validate_engine_kwargs({"model": model, **kwargs})
        self.client: EngineClient
        if address is None and resolve_executor_backend(args, "offline") == "ray":
            from cluster.ray_cluster import connect

            connect()  # the ranks need a cluster: RAY_ADDRESS, `ray start`'s, or a new one
        if address is None:
            from cluster.engine.local import InProcessEngineClient

            self.client = InProcessEngineClient.from_engine_args(args)
        else:
            from cluster.engine.ray_client import RayEngineClient

            self.client = RayEngineClient.start(args, address=address)
        self.info: EngineInfo = self.client.get_info()
        self.tokenizer = self.client.get_tokenizer()
        multimodal = load_multimodal_inputs(
            self.info.model_path, MultiModalConfig.from_engine_args(args)
        )
        self.inputs = InputProcessor(
            self.tokenizer,
            self.info.vocab_size,
            self.info.max_model_len,
            self.info.model_path,
            multimodal,
        )
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        # At interpreter exit, before Ray's own exit hook (registered earlier, run later):
        # the engine's workers are stopped while Ray can still be reached.
        atexit.register(self._finalizer)
        self._req_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (None when the model folder has none)."""
        return self.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, token-ID lists or prompt dicts), in input order.

        A prompt with images is vLLM's `{"prompt": text, "multi_modal_data": {"image": image or
        [images]}}` (PIL images; the text holds the model's image placeholder once per image).

        `priority` (one per prompt, lower first) orders the queue when the engine runs with
        `scheduling_policy="priority"`. `lora_request` (one for all prompts, or one per prompt)
        runs prompts with an adapter (needs `enable_lora=True`). Invalid input raises TypeError
        or ValueError naming the prompt before any of the prompts is queued; the LLM stays usable.
        """
        self._check_open()
        prompt_list = as_prompt_list(prompts)
        params_list = as_params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(
                f"priority has {len(priority)} values for {len(prompt_list)} prompts: "
                "give one per prompt"
            )
        tokenized = [self._tokenize(index, prompt) for index, prompt in enumerate(prompt_list)]
        loras = as_lora_list(lora_request, len(prompt_list))
        return self._run(tokenized, params_list, use_tqdm, priority, loras)

    def chat(  # noqa: PLR0913 (vLLM's signature)
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """The assistant's reply to one conversation, or to each of a list of conversations.

        A conversation is a list of `{"role": ..., "content": ...}` messages, rendered with the
        tokenizer's chat template (or `chat_template`); `.prompt` holds the rendered text.
        Content may be a list of parts: text, `{"type": "image_url", "image_url": {"url": ...}}`
        (data:, http(s):// or allowed file:// URLs) or `{"type": "image_pil", "image_pil": image}`.
        `tools` (OpenAI function definitions) are passed to the template, as vLLM does; constrain
        the reply with `SamplingParams(structured_outputs=...)`.
        """
        self._check_open()
        conversations = as_conversation_list(messages)
        params_list = as_params_list(sampling_params, len(conversations))
        rendered = [
            self._render_chat(index, conv, chat_template, add_generation_prompt, tools)
            for index, conv in enumerate(conversations)
        ]
        loras = as_lora_list(lora_request, len(conversations))
        return self._run(rendered, params_list, use_tqdm, loras=loras)

    def stream(
        self, prompt: PromptInput, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """One prompt's output deltas as they are generated (closing the stream aborts it)."""
        self._check_open()
        (params,) = as_params_list(sampling_params, 1)
        (request,) = self._requests([self._tokenize(0, prompt)], [params])
        return self.client.add_request(request)

    def stream_chat(
        self,
        conversation: Sequence[ChatMessage],
        sampling_params: SamplingParams | None = None,
        chat_template: str | None = None,
    ) -> Iterator[RequestOutput]:
        """The reply to one conversation as it is generated."""
        self._check_open()
        (params,) = as_params_list(sampling_params, 1)
        (conv,) = as_conversation_list([conversation])
        (request,) = self._requests([self._render_chat(0, conv, chat_template, True)], [params])
        return self.client.add_request(request)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics under vLLM's names (request counts, KV usage, prefix cache,
        speculative decoding acceptance), as vLLM's `LLM.get_metrics()` gives them."""
        self._check_open()
        return read_metrics(self.client.get_stats())

    def control(self, name: str, *args: object) -> Any:
        self._check_open()
        return self.client.control(name, *args)

    def weight_call(self, name: str, *args: object) -> Any:
        """A weight-transfer call: `init_weight_transfer_engine`, `start_weight_update`,
        `update_weights`, `finish_weight_update`, `get_weight_version`, `reload_weights`
        (`cluster.engine.weight_calls`)."""
        self._check_open()
        return self.client.weight_call(name, *args)

    def shutdown(self) -> None:
        """Stop the engine and its workers (also done when the LLM is garbage-collected and
        at interpreter exit)."""
        atexit.unregister(self._finalizer)
        self._finalizer()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this LLM has been shut down; create a new one")

    def _run(
        self,
        prompts: Sequence[Prompt],
        params_list: Sequence[SamplingParams],
        use_tqdm: bool | None,
        priorities: Sequence[int] | None = None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Queue every prompt, read every stream to its end."""
        requests = self._requests(prompts, params_list, priorities, loras)
        streams = self._add_requests(requests)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        results: list[RequestOutput] = []
        try:
            with tqdm(total=len(streams), desc="Generating", disable=not show) as bar:
                for stream in streams:
                    results.append(collect(stream))
                    bar.update(1)
        except BaseException:  # an error or Ctrl-C: nothing of this call stays in the engine
            for request in requests[len(results) :]:
                self.client.abort(request.request_id)
            raise
        return results

    def _requests(
        self,
        prompts: Sequence[Prompt],
        params_list: Sequence[SamplingParams],
        priorities: Sequence[int] | None = None,
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[EngineRequest]:
        requests = []
        for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
            self._warn_if_capped(index, len(prompt.token_ids), params.max_tokens)
            requests.append(
                EngineRequest(
                    request_id=str(next(self._req_counter)),
                    prompt_token_ids=tuple(prompt.token_ids),
                    sampling_params=params,
                    prompt=prompt.text,
                    priority=0 if priorities is None else priorities[index],
                    lora_request=None if loras is None else loras[index],
                    mm_features=prompt.mm_features,
                )
            )
        return requests

    def _warn_if_capped(self, index: int, num_prompt_tokens: int, max_tokens: int) -> None:
        room = self.info.max_model_len - num_prompt_tokens
        if 0 < room < max_tokens:
            logger.warning(
                "prompt %d: max_tokens=%d exceeds what max_model_len=%d leaves after its %d "
                "prompt tokens; it stops after at most %d tokens",
                index,
                max_tokens,
                self.info.max_model_len,
                num_prompt_tokens,
                room,
            )

    def _add_requests(self, requests: Sequence[EngineRequest]) -> list[Iterator[RequestOutput]]:
        """Queue all of `requests` or, when the engine refuses one, none of them."""
        streams: list[Iterator[RequestOutput]] = []
        for index, request in enumerate(requests):
            try:
                streams.append(self.client.add_request(request))
            except ValueError as exc:
                for added in requests[:index]:
                    self.client.abort(added.request_id)
                raise ValueError(f"prompt {index}: {exc}") from None
        return streams

    def _tokenize(self, index: int, prompt: PromptInput) -> Prompt:
        """Prompt `index` checked: its text (or None), token IDs and images."""
        return self.inputs.prompt(prompt, index)

    def _render_chat(
        self,
        index: int,
        conversation: Sequence[ChatMessage],
        chat_template: str | None,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Prompt:
        """Conversation `index` as template text, its token IDs (the template adds BOS) and
        its images."""
        return self.inputs.chat(conversation, chat_template, add_generation_prompt, index, tools)

"""Offline generation: `LLM(...).generate(prompts, sampling_params)` runs the engine in-process.

No Ray: the engine core and its executor (one process per tensor-parallel rank when
`tensor_parallel_size > 1`) live in the caller's process tree. Results come back in input order.
`chat(messages)` renders conversations with the tokenizer's chat template first. A call's
prompts are all checked (`cluster.llm_inputs`) before any is queued, and a failing call aborts
what it queued, so an error never leaves work behind in the engine.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cluster.engine_args import EngineArgs
from cluster.engine_core import EngineCore, build_engine_core
from cluster.llm_inputs import (
    ChatMessage,
    PromptInput,
    as_conversation_list,
    as_params_list,
    as_prompt_list,
    check_token_ids,
)
from cluster.llm_outputs import CompletionResult, RequestTracker
from scheduler.request import Request, SamplingParams
from worker.config import ModelConfig

logger = logging.getLogger(__name__)


class LLM:
    """An offline engine for one model; arguments follow vLLM's engine arguments."""

    def __init__(  # noqa: PLR0913 (vLLM's engine arguments, keyword-only; see EngineArgs)
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        disable_hybrid_kv_cache_manager: bool = False,
        tensor_parallel_size: int = 1,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int = 256,
        attention_backend: str = "auto",
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        kv_sharing_fast_prefill: bool = False,
    ) -> None:
        args = EngineArgs(
            model=model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            tensor_parallel_size=tensor_parallel_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            attention_backend=attention_backend,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            kv_sharing_fast_prefill=kv_sharing_fast_prefill,
        )
        configs = args.to_configs()
        self.model_config: ModelConfig = configs.model
        self.tokenizer = load_tokenizer(configs.model.tokenizer_path)
        self.engine: EngineCore = build_engine_core(configs)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._req_counter = itertools.count()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionResult]:
        """Generate for every prompt (strings or token-ID lists); results in input order.

        Invalid input raises TypeError or ValueError naming the prompt before any of the
        prompts is queued; the LLM stays usable.
        """
        self._check_open()
        prompt_list = as_prompt_list(prompts)
        params_list = as_params_list(sampling_params, len(prompt_list))
        tokenized = [
            (prompt if isinstance(prompt, str) else None, self._tokenize(index, prompt))
            for index, prompt in enumerate(prompt_list)
        ]
        return self._run(tokenized, params_list, use_tqdm)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionResult]:
        """The assistant's reply to one conversation, or to each of a list of conversations.

        A conversation is a list of `{"role": ..., "content": ...}` messages, rendered with the
        tokenizer's chat template and its generation prompt; `.prompt` holds the rendered text.
        """
        self._check_open()
        conversations = as_conversation_list(messages)
        params_list = as_params_list(sampling_params, len(conversations))
        rendered = [self._render_chat(index, conv) for index, conv in enumerate(conversations)]
        return self._run(rendered, params_list, use_tqdm)

    def shutdown(self) -> None:
        """Stop the workers (also done when the LLM is garbage-collected)."""
        self._finalizer()

    @property
    def _is_shut_down(self) -> bool:
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self._is_shut_down:
            raise RuntimeError("this LLM has been shut down; create a new one")

    def _run(
        self,
        prompts: Sequence[tuple[str | None, Sequence[object]]],
        params_list: Sequence[SamplingParams],
        use_tqdm: bool,
    ) -> list[CompletionResult]:
        """Queue every (text, token IDs) prompt, step the engine until all finish."""
        pairs = zip(prompts, params_list, strict=True)
        requests = [
            self._make_request(index, text, token_ids, params)
            for index, ((text, token_ids), params) in enumerate(pairs)
        ]
        self._add_requests([request for request, _ in requests])
        trackers = {tracker.req_id: tracker for _, tracker in requests}
        try:
            with tqdm(total=len(trackers), desc="Generating", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        tracker = trackers.get(output.req_id)
                        if tracker is not None:  # else: left over from an interrupted call
                            tracker.update(output)
                            bar.update(int(output.finished))
        except BaseException:
            self.engine.abort(trackers)
            raise
        return [tracker.result(self.tokenizer) for tracker in trackers.values()]

    def _make_request(
        self, index: int, text: str | None, token_ids: Sequence[object], params: SamplingParams
    ) -> tuple[Request, RequestTracker]:
        """The engine request of prompt `index` (validated, not yet queued) and its tracker."""
        checked_ids = check_token_ids(index, token_ids, self.model_config.vocab_size)
        eos_ids = self.model_config.eos_token_ids
        if len(eos_ids) > 1 and not params.ignore_eos:
            extra = tuple(t for t in eos_ids[1:] if t not in params.stop_token_ids)
            params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(
            req_id=str(next(self._req_counter)),
            prompt_token_ids=checked_ids,
            sampling_params=params,
            hash_block_size=self.engine.scheduler.hash_block_size,
            eos_token_id=eos_ids[0] if eos_ids else None,
        )
        return request, RequestTracker(request.req_id, text, checked_ids, params)

    def _add_requests(self, requests: Sequence[Request]) -> None:
        """Queue all of `requests` or, when the scheduler refuses one, none of them."""
        added: list[str] = []
        for index, request in enumerate(requests):
            try:
                self.engine.add_request(request)
            except ValueError as exc:
                self.engine.abort(added)
                raise ValueError(f"prompt {index}: {exc}") from None
            added.append(request.req_id)

    def _tokenize(self, index: int, prompt: PromptInput) -> Sequence[object]:
        if not isinstance(prompt, str):
            return prompt
        tokenizer = self._require_tokenizer(f"prompt {index} is text")
        token_ids: list[int] = tokenizer(prompt).input_ids
        return token_ids

    def _render_chat(
        self, index: int, conversation: Sequence[ChatMessage]
    ) -> tuple[str, list[int]]:
        """Conversation `index` as template text and its token IDs (the template adds BOS)."""
        tokenizer = self._require_tokenizer("chat messages are rendered by the tokenizer")
        if not tokenizer.chat_template:
            raise ValueError(
                f"the tokenizer of {self.model_config.model_path} has no chat template"
            )
        messages = cast("list[dict[str, str]]", [dict(message) for message in conversation])
        text = str(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        )
        token_ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
        return text, token_ids

    def _require_tokenizer(self, why: str) -> PreTrainedTokenizerBase:
        if self.tokenizer is None:
            raise ValueError(
                f"{why}, but {self.model_config.model_path} has no tokenizer; "
                "pass prompts as token IDs"
            )
        return self.tokenizer


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The model folder's tokenizer, or None when the folder has none."""
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path, local_files_only=True
        )
    except (OSError, ValueError, TypeError) as exc:
        logger.info("no tokenizer in %s (%s): prompts must be token IDs", path, exc)
        return None
    return tokenizer

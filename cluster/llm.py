"""Offline generation: `LLM(...).generate(prompts, sampling_params)` runs the engine in-process.

No Ray: the engine core and its executor (one process per tensor-parallel rank when
`tensor_parallel_size > 1`) live in the caller's process tree. Results come back in input order.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cluster.engine_args import EngineArgs
from cluster.engine_core import EngineCore, build_engine_core
from scheduler.output import RequestOutput, TokenLogprobs
from scheduler.request import Request, SamplingParams
from worker.config import ModelConfig

logger = logging.getLogger(__name__)

PromptInput = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    """Decoded text (special tokens skipped); empty when the model has no tokenizer."""
    token_ids: list[int]
    finish_reason: str | None
    """"stop", "length" or "abort"."""
    stop_token_id: int | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class CompletionResult:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs] | None = None
    """Logprobs of prompt tokens 1..n-1 (token 0 has none), when asked for."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class _Tracker:
    """Accumulates one request's step outputs."""

    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    last: RequestOutput | None = None

    def update(self, output: RequestOutput) -> None:
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs or [])
        self.prompt_logprobs.extend(output.prompt_logprobs or [])
        self.last = output

    def result(self, tokenizer: PreTrainedTokenizerBase | None) -> CompletionResult:
        last = self.last
        text = str(tokenizer.decode(self.token_ids, skip_special_tokens=True)) if tokenizer else ""
        output = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(self.token_ids),
            finish_reason=last.finish_reason.value if last and last.finish_reason else None,
            stop_token_id=last.stop_token_id if last else None,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
        )
        return CompletionResult(
            request_id=self.req_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[output],
            prompt_logprobs=(
                list(self.prompt_logprobs) if self.params.prompt_logprobs is not None else None
            ),
            num_cached_tokens=last.num_cached_tokens if last else 0,
        )


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
        """Generate for every prompt (strings or token-ID lists); results in input order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        trackers = [
            self._add_request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)
        ]
        by_id = {tracker.req_id: tracker for tracker in trackers}
        try:
            with tqdm(total=len(trackers), desc="Generating", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        tracker = by_id.get(output.req_id)
                        if tracker is not None:  # else: left over from an interrupted call
                            tracker.update(output)
                            bar.update(int(output.finished))
        except BaseException:
            self.engine.abort(by_id)
            raise
        return [tracker.result(self.tokenizer) for tracker in trackers]

    def shutdown(self) -> None:
        """Stop the workers (also done when the LLM is garbage-collected)."""
        self._finalizer()

    def _add_request(self, prompt: PromptInput, params: SamplingParams) -> _Tracker:
        text = prompt if isinstance(prompt, str) else None
        token_ids = self._tokenize(prompt)
        eos_ids = self.model_config.eos_token_ids
        if len(eos_ids) > 1 and not params.ignore_eos:
            extra = tuple(t for t in eos_ids[1:] if t not in params.stop_token_ids)
            params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        req_id = str(next(self._req_counter))
        self.engine.add_request(
            Request(
                req_id=req_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                hash_block_size=self.engine.scheduler.hash_block_size,
                eos_token_id=eos_ids[0] if eos_ids else None,
            )
        )
        return _Tracker(req_id, text, token_ids, params)

    def _tokenize(self, prompt: PromptInput) -> list[int]:
        if not isinstance(prompt, str):
            return [int(token) for token in prompt]
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model_config.model_path} has no tokenizer: pass prompts as token IDs"
            )
        token_ids: list[int] = self.tokenizer(prompt).input_ids
        return token_ids


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


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(item, int) for item in items):
        return [items]  # type: ignore[list-item]  # one prompt given as token IDs
    return items  # type: ignore[return-value]


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts")
    return params

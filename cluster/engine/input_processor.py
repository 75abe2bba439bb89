"""The one input processor: prompts, chat messages and OpenAI requests -> checked token IDs and
`SamplingParams`, with the same rules and the same errors for `LLM`, the Serve replica and batch.

    text prompt ──tokenize──┐
    token IDs ──────────────┼─► check IDs (non-empty, ints, in the vocabulary) ─► Prompt
    messages ──chat template┘
    messages with images / {"prompt", "multi_modal_data"} ─► the model's HF processor
        (cluster.engine.mm_inputs) ─► Prompt with one MultiModalFeature per placeholder run
    OpenAI request ─► Prompt + room left in the context ─► SamplingParams (cluster.openai_api)

Every refusal is a ValueError (TypeError for a wrong type) naming what to fix.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.engine.mm_inputs import MultiModalConfig, MultiModalInputs
from cluster.openai_api.content_parts import template_messages
from cluster.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.openai_api.sampling import to_sampling_params
from cluster.openai_api.tools import tool_dicts
from scheduler.multimodal import MultiModalFeature
from scheduler.request import SamplingParams

PromptInput = str | Sequence[int] | Mapping[str, object]
"""A prompt: text, token IDs, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}` dicts
(`{"prompt": text, "multi_modal_data": {"image": image or [images]}}` with images)."""
ChatMessage = Mapping[str, object]
"""One chat message: {"role": "user" | "assistant" | "system", "content": ...}."""


@dataclass(frozen=True)
class Prompt:
    """A prompt ready for the engine: its text (None when given as IDs), its token IDs and
    its images (placeholder runs in the token IDs)."""

    text: str | None
    token_ids: list[int]
    mm_features: tuple[MultiModalFeature, ...] = ()


def is_token_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_token_ids(index: int, token_ids: Sequence[object], vocab_size: int) -> list[int]:
    """Prompt `index` as a list of ints, each a token of the model's vocabulary."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"prompt {index}: token IDs must be a list of ints")
    if len(token_ids) == 0:
        raise ValueError(f"prompt {index} is empty: send at least one token")
    for token in token_ids:
        if not is_token_id(token):
            raise TypeError(f"prompt {index}: token IDs must be ints, got {token!r}")
    ids = [int(token) for token in token_ids]  # type: ignore[call-overload]
    outside = [token for token in ids if not 0 <= token < vocab_size]
    if outside:
        raise ValueError(
            f"prompt {index}: token ID {outside[0]} is outside the model's vocabulary "
            f"[0, {vocab_size})"
        )
    return ids


class InputProcessor:
    """Turns what callers send into what the engine runs, for one model."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        model_path: str,
        multimodal: MultiModalInputs | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_path = model_path
        self.multimodal = multimodal or MultiModalInputs(None, None, MultiModalConfig())
        """Image processing (one that refuses images when the model takes none)."""

    def prompt(self, prompt: PromptInput, index: int = 0) -> Prompt:
        """A text prompt tokenized (with the tokenizer's special tokens), or IDs checked."""
        if isinstance(prompt, Mapping):
            if prompt.get("multi_modal_data") is not None:
                return self._prompt_with_images(prompt, index)
            ids = prompt.get("prompt_token_ids")
            text = prompt.get("prompt")
            if ids is None:
                return self.prompt(str(text), index)
            return Prompt(None if text is None else str(text), self._ids(index, ids))
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty: send some text")
            tokenizer = self._require_tokenizer(f"prompt {index} is text")
            return Prompt(prompt, self._ids(index, tokenizer(prompt).input_ids))
        return Prompt(None, self._ids(index, prompt))

    def chat(
        self,
        messages: Sequence[ChatMessage],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        index: int = 0,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> Prompt:
        """A conversation rendered by the chat template (which adds BOS), and its IDs; `tools`
        (OpenAI's function definitions) go to the template as its `tools`."""
        _check_messages(messages)
        rendered, image_refs = template_messages(messages)
        self.multimodal.check_images([ref.where for ref in image_refs])
        tokenizer = self._require_tokenizer("chat messages are rendered by the tokenizer")
        template = self._chat_template(chat_template)
        extra = {"tools": list(tools)} if tools else {}
        try:
            text = str(
                tokenizer.apply_chat_template(
                    rendered,
                    chat_template=template,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **extra,
                )
            )
        except Exception as error:  # a template error is the messages' fault
            raise ValueError(f"the chat template failed on these messages: {error}") from None
        if image_refs:
            images = self.multimodal.load(image_refs)
            ids, features = self.multimodal.process(text, images, add_special_tokens=False)
            return Prompt(text, self._ids(index, ids), features)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return Prompt(text, self._ids(index, ids))

    def openai(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        token_ids: Sequence[int] | None = None,
    ) -> tuple[Prompt, SamplingParams]:
        """An OpenAI request's prompt and sampling parameters (`max_tokens` checked against
        the room its prompt leaves in the context); `token_ids`: the prompt as a router
        already tokenized it with this model's tokenizer."""
        if token_ids is not None:
            text = request.prompt if isinstance(request, CompletionRequest) else None
            prompt = Prompt(text if isinstance(text, str) else None, self._ids(0, token_ids))
        elif isinstance(request, ChatCompletionRequest):
            generation = request.add_generation_prompt
            prompt = self.chat(
                request.messages, request.chat_template, generation, tools=tool_dicts(request)
            )
        else:
            prompt = self.prompt(request.prompt)  # type: ignore[arg-type]
            if request.echo and prompt.text is None and self.tokenizer is not None:
                prompt = Prompt(self.tokenizer.decode(prompt.token_ids), prompt.token_ids)
        room = self.max_model_len - len(prompt.token_ids)
        if room <= 0:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {len(prompt.token_ids)} tokens"
            )
        return prompt, to_sampling_params(request, _max_tokens(request, room))

    def _prompt_with_images(self, prompt: Mapping[str, object], index: int) -> Prompt:
        """vLLM's `{"prompt": text with one placeholder per image, "multi_modal_data":
        {"image": image or [images]}}`, processed by the model's processor (which adds the
        tokenizer's special tokens, as a text prompt gets)."""
        data = prompt["multi_modal_data"]
        where = f"prompt {index}: multi_modal_data"
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            raise ValueError(f'{where} must be {{"image": image or [images]}}, got {data!r:.80}')
        text = prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError(f"{where} needs the prompt as text (with the image placeholders)")
        images = self.multimodal.checked_images(data.get("image", []), f"{where}['image']")
        if not images:
            return self.prompt(text, index)
        try:
            ids, features = self.multimodal.process(text, images, add_special_tokens=True)
        except ValueError as error:
            raise ValueError(f"prompt {index}: {error}") from None
        return Prompt(text, self._ids(index, ids), features)

    def _chat_template(self, chat_template: str | None) -> str:
        """The request's template, else the tokenizer's, else the processor's."""
        processor = self.multimodal.processor
        template = (
            chat_template
            or self.tokenizer.chat_template
            or getattr(processor, "chat_template", None)
        )
        if not template:
            raise ValueError(f"the tokenizer of {self.model_path} has no chat template")
        return str(template)

    def _ids(self, index: int, token_ids: object) -> list[int]:
        return check_token_ids(index, token_ids, self.vocab_size)  # type: ignore[arg-type]

    def _require_tokenizer(self, why: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"{why}, but {self.model_path} has no tokenizer; send the prompt as token IDs"
            )
        return self.tokenizer


def _check_messages(messages: object) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"messages[{index}] must be an object with a 'role', got {message!r}")


def _max_tokens(request: CompletionRequest | ChatCompletionRequest, room: int) -> int:
    """The client's limit (max_completion_tokens first), else whatever fits in the context."""
    asked = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        asked = request.max_completion_tokens
    if asked is None:
        return room
    if asked == 0:  # echo only (checked by the request model): score the prompt, keep nothing
        return 1
    if asked > room:
        raise ValueError(
            f"max_tokens={asked} is too large: the prompt leaves room for {room} tokens "
            "in this model's context"
        )
    return asked

"""The call shapes `LLM.generate` and `LLM.chat` accept, checked before anything runs (each
prompt is then processed by `cluster.engine.input_processor`).

Prompts are strings or token-ID lists, alone or in a list; conversations are lists of
role/content messages, alone or in a list; sampling parameters are one
`SamplingParams` for every prompt or a list with one per prompt. Wrong types raise TypeError,
bad values ValueError, both naming the prompt's index, so a caller can fix the input and call
again on the same engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from cluster.engine.input_processor import ChatMessage, PromptInput, is_token_id
from scheduler.lora import LoRARequest
from scheduler.request import SamplingParams

_T = TypeVar("_T")


def as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    """One prompt or a list of prompts -> a list of prompts (a flat ID list is one prompt)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(
            "prompts must be a string, a list of token IDs, or a list of those; got "
            f"{type(prompts).__name__}"
        )
    items = list(prompts)
    if items and all(is_token_id(item) for item in items):
        return [items]  # type: ignore[list-item]  # one prompt given as token IDs
    for index, item in enumerate(items):
        _check_prompt(index, item)
    return items  # type: ignore[return-value]


def _check_prompt(index: int, item: object) -> None:
    if isinstance(item, Mapping):
        if not ({"prompt", "prompt_token_ids"} & item.keys()):
            raise TypeError(f"prompt {index}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        unknown = set(item) - {"prompt", "prompt_token_ids", "multi_modal_data"}
        if unknown:
            raise TypeError(f"prompt {index}: unknown prompt dict keys {sorted(unknown)}")
        return
    if not isinstance(item, (str, Sequence)):
        raise TypeError(
            f"prompt {index} must be a string, a list of token IDs or a prompt dict, "
            f"got {type(item).__name__}"
        )


def as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    """One `SamplingParams` per prompt (None means the defaults for every prompt)."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
        raise TypeError(
            "sampling_params must be a SamplingParams, a list with one per prompt, or None; "
            f"got {type(sampling_params).__name__} (build one with SamplingParams(...))"
        )
    params = _one_per_prompt(sampling_params, num_prompts, "sampling params", "SamplingParams")
    for index, item in enumerate(params):
        if not isinstance(item, SamplingParams):
            raise TypeError(
                f"sampling_params[{index}] must be a SamplingParams, got {type(item).__name__}"
            )
    return params


def as_conversation_list(
    messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
) -> list[Sequence[ChatMessage]]:
    """One conversation (a list of messages) or a list of them -> a list of conversations."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise TypeError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, or a list of such "
            f"conversations; got {type(messages).__name__}"
        )
    items = list(messages)
    conversations = [items] if items and isinstance(items[0], Mapping) else items
    for index, conversation in enumerate(conversations):
        _check_conversation(index, conversation)
    return conversations  # type: ignore[return-value]


def _check_conversation(index: int, conversation: object) -> None:
    if not isinstance(conversation, Sequence) or isinstance(conversation, str) or not conversation:
        raise TypeError(f"conversation {index} must be a non-empty list of messages")
    for message in conversation:
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            raise TypeError(
                f"conversation {index}: every message must be a dict with 'role' and 'content', "
                f"got {message!r}"
            )


def as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None] | None:
    """One adapter (or None) per prompt; None when no prompt has one."""
    if lora_request is None:
        return None
    if isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = _one_per_prompt(lora_request, num_prompts, "lora requests", "LoRARequest")
    for index, item in enumerate(loras):
        if item is not None and not isinstance(item, LoRARequest):
            raise TypeError(
                f"lora_request[{index}] must be a LoRARequest or None, got {type(item).__name__}"
            )
    return loras


def _one_per_prompt(items: Sequence[_T], num_prompts: int, noun: str, single: str) -> list[_T]:
    """`items` as a list, ValueError unless it has one item per prompt."""
    values = list(items)
    if len(values) != num_prompts:
        raise ValueError(
            f"got {len(values)} {noun} for {num_prompts} prompts: pass one per prompt, "
            f"or a single {single} for all of them"
        )
    return values

"""Request prompts -> (text, token IDs): completion prompts as given, chat via the template."""

from __future__ import annotations

from typing import Any

from cluster.serve.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest


def _content_text(message: ChatMessage) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type", "text") != "text":
            raise ValueError(f"content parts of type {part.get('type')!r} are not supported")
        parts.append(part.get("text", ""))
    return "".join(parts)


def render_chat(tokenizer: Any, request: ChatCompletionRequest) -> tuple[str, list[int]]:
    """The conversation rendered by the chat template (the template adds BOS) and its IDs."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat messages cannot be rendered")
    template = request.chat_template or tokenizer.chat_template
    if not template:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    messages = [{"role": m["role"], "content": _content_text(m)} for m in request.messages]
    try:
        text = str(
            tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=request.add_generation_prompt,
                tokenize=False,
            )
        )
    except Exception as error:  # a template error is the request's fault (its messages)
        raise ValueError(f"the chat template failed on these messages: {error}") from None
    return text, list(tokenizer(text, add_special_tokens=False).input_ids)


def render_prompt(
    tokenizer: Any, request: CompletionRequest | ChatCompletionRequest
) -> tuple[str | None, list[int]]:
    """(prompt text or None, token IDs) of a request."""
    if isinstance(request, ChatCompletionRequest):
        return render_chat(tokenizer, request)
    prompt = request.prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: send the prompt as token IDs")
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, list(tokenizer(prompt).input_ids)
    ids = [int(t) for t in prompt]  # type: ignore[arg-type]
    text = None
    if tokenizer is not None and request.echo:
        if max(ids) >= len(tokenizer):
            raise ValueError(f"prompt token ID {max(ids)} is out of the vocabulary")
        text = tokenizer.decode(ids)
    return text, ids

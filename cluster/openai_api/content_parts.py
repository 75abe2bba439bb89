"""Chat message content as OpenAI and vLLM send it: text, or a list of parts.

    "content": "text"                                              text
    "content": [{"type": "text", "text": ...},                     text part
                {"type": "image_url", "image_url": {"url": ...}},  image by URL (OpenAI)
                {"type": "image_pil", "image_pil": PIL.Image}]     image object (vLLM, offline)

`template_messages` gives the messages as chat templates read them (a message with images keeps
its parts, each image as `{"type": "image"}`, as transformers' processors pass them; a
text-only message has its text joined) and the images in prompt order, each with its place in
the request (`messages[0].content[1]`) for error messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

IMAGE_PART_TYPES = ("image_url", "image_pil")
_PASSED_KEYS = ("name", "tool_calls", "tool_call_id")
"""Message keys the template sees besides role and content (tool calls and their results)."""


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request."""

    where: str
    """Its place in the request, e.g. `messages[0].content[1]`."""
    url: str | None = None
    """An image_url part's URL."""
    image: Any = None
    """An image_pil part's image object."""


def template_messages(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """The messages as the chat template reads them, and their images in prompt order."""
    rendered: list[dict[str, Any]] = []
    images: list[ImageRef] = []
    for index, message in enumerate(messages):
        content, refs = _content(index, message.get("content"))
        entry = {"role": message["role"], "content": content}
        entry.update({key: message[key] for key in _PASSED_KEYS if key in message})
        rendered.append(entry)
        images.extend(refs)
    return rendered, images


def first_image_part(messages: object) -> str | None:
    """Where the first image part of `messages` is (None: text only), without checking them."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return None
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, Sequence) and not isinstance(content, str):
            for position, part in enumerate(content):
                if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                    return f"messages[{index}].content[{position}]"
    return None


def _content(index: int, content: object) -> tuple[str | list[dict[str, Any]], list[ImageRef]]:
    if content is None or isinstance(content, str):
        return content or "", []
    if not isinstance(content, Sequence):
        raise TypeError(f"messages[{index}]: content must be text or a list of parts")
    parts: list[dict[str, Any]] = []
    refs: list[ImageRef] = []
    for position, part in enumerate(content):
        where = f"messages[{index}].content[{position}]"
        kind = part.get("type", "text") if isinstance(part, Mapping) else type(part).__name__
        if kind == "text":
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind in IMAGE_PART_TYPES:
            refs.append(_image_ref(where, part))
            parts.append({"type": "image"})
        else:
            raise ValueError(f"{where}: content parts of type {kind!r} are not supported")
    if not refs:
        return "".join(part["text"] for part in parts), []
    return parts, refs


def _image_ref(where: str, part: Mapping[str, Any]) -> ImageRef:
    if part["type"] == "image_pil":
        if part.get("image_pil") is None:
            raise ValueError(f"{where}: an image_pil part needs its image in 'image_pil'")
        return ImageRef(where, image=part["image_pil"])
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f'{where}: an image_url part needs {{"image_url": {{"url": ...}}}}')
    return ImageRef(where, url=url)

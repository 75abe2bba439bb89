"""Where a prefill chunk may end around the images of a prompt, and the encoder budget.

An image's encoder runs once, in the step whose chunk first reaches it (or the first chunk
after a prefix hit that ends inside it); the worker keeps the output until the request has
computed past the image, so later chunks read slices of it. Two rules cut a chunk short, always
just before an image starts:

- the encoder budget: the images a step encodes hold at most `encoder_budget` positions in
  all (vLLM's encoder compute budget, default the step's token budget);
- whole images (models whose image tokens attend to each other both ways, Gemma 3): a chunk
  never ends inside an image, since the image's queries must see every one of its keys. A
  chunk may start inside one (after a hit): the cached part was computed with the whole image
  in view, so only the rest must come in one piece.

A chunk that cannot reach past such an image waits (0 tokens); `check_images` refuses at
admission the images no step could ever take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from scheduler.multimodal import MultiModalFeature


class ImageChunk(NamedTuple):
    """Tokens to compute this step and the encoder positions they use."""

    num_new: int
    encoder_tokens: int


def limit_chunk(
    features: Sequence[MultiModalFeature],
    start: int,
    num_new: int,
    *,
    first_chunk: bool,
    whole_images: bool,
    encoder_budget: int,
) -> ImageChunk:
    """The chunk [start, start + num_new) cut by the rules of the module docstring.

    `first_chunk`: the request's first chunk since admission, so an image it starts inside is
    encoded now; `encoder_budget`: encoder positions still free this step.
    """
    end = start + num_new
    used = 0
    for feature in features:
        if feature.end <= start:
            continue
        if feature.offset >= end:
            break
        encoded_now = feature.offset >= start or first_chunk
        over_budget = encoded_now and used + feature.length > encoder_budget
        if over_budget or (whole_images and feature.end > end):
            return ImageChunk(max(feature.offset - start, 0), used)
        used += feature.length if encoded_now else 0
    return ImageChunk(num_new, used)


def encoder_positions(
    features: Sequence[MultiModalFeature], start: int, num_new: int, first_chunk: bool
) -> int:
    """Positions of the images the chunk [start, start + num_new) encodes."""
    return limit_chunk(
        features,
        start,
        num_new,
        first_chunk=first_chunk,
        whole_images=False,
        encoder_budget=sum(feature.length for feature in features),
    ).encoder_tokens


def check_images(
    req_id: str,
    features: Sequence[MultiModalFeature],
    *,
    whole_images: bool,
    encoder_budget: int,
    max_chunk: int,
) -> None:
    """ValueError naming the image when no step could ever take it."""
    for index, feature in enumerate(features):
        if feature.length > encoder_budget:
            raise ValueError(
                f"request {req_id!r}: image {index} fills {feature.length} positions, more than "
                f"the encoder budget of {encoder_budget} a step; raise max_num_batched_tokens "
                "or send a smaller image"
            )
        if whole_images and feature.length > max_chunk:
            raise ValueError(
                f"request {req_id!r}: image {index} fills {feature.length} positions, which "
                f"this model must compute in one chunk of at most {max_chunk} tokens; raise "
                "max_num_batched_tokens or send a smaller image"
            )

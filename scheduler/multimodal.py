"""Images (and other non-text inputs) inside a prompt, as the scheduler sees them.

The input processor expands each image into a run of placeholder tokens in the prompt and
hands the engine one `MultiModalFeature` per image: where its run starts, how many positions its
encoder output fills, a content hash, and the processed inputs its encoder reads (opaque here).

Prefix caching keys blocks by their tokens, and an image's placeholder tokens are the same for
every image. So every cache key is computed over `cache_token_ids`: the tokens with each image's
positions replaced by a value derived from its content hash (negative, so never a vocabulary
token). The same image at the same place gives the same keys; another image, or the same one
elsewhere, gives others from its first position on. One replacement serves every key built
from tokens: block hashes, state-checkpoint keys and the tails of answer ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

IDENTITY_TOKEN_BITS = 62
"""Identity tokens lie in [-2**62, -1]: negative, and inside a signed 64-bit hash word."""


@dataclass(frozen=True)
class MultiModalFeature:
    """One image of a prompt (its placeholder run and what its encoder reads)."""

    modality: str
    """"image"."""
    identifier: str
    """Hash of the content (and the processing options that change the encoder's output): the
    key of the worker's encoder cache and of the prefix cache."""
    offset: int
    """First prompt position the encoder output fills."""
    length: int
    """Prompt positions the encoder output fills (its rows), from `offset` on."""
    data: Any = field(default=None, compare=False, repr=False)
    """Processed encoder inputs (pixel values, grid sizes, ...), read by the worker only."""

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(
                f"{self.modality} {self.identifier[:12]}: placeholder run at {self.offset} of "
                f"length {self.length} is empty or negative"
            )

    @property
    def end(self) -> int:
        """One past the last position the encoder output fills."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions [start, end) include any of this feature's."""
        return start < self.end and self.offset < end


def identity_token(identifier: str) -> int:
    """The value standing for every position of the feature `identifier` in cache keys."""
    digest = xxhash.xxh3_64_intdigest(identifier.encode())
    return -1 - (digest % (1 << IDENTITY_TOKEN_BITS))


def cache_token_ids(token_ids: Sequence[int], features: Sequence[MultiModalFeature]) -> list[int]:
    """`token_ids` with each feature's positions replaced by its identity token."""
    keyed = list(token_ids)
    for feature in features:
        if feature.end > len(keyed):
            raise ValueError(
                f"{feature.modality} {feature.identifier[:12]} fills positions "
                f"[{feature.offset}, {feature.end}) of a {len(keyed)}-token prompt"
            )
        keyed[feature.offset : feature.end] = [identity_token(feature.identifier)] * feature.length
    return keyed


def check_features(features: Sequence[MultiModalFeature], num_prompt_tokens: int) -> None:
    """ValueError unless the features lie inside the prompt, in order, without overlapping."""
    previous_end = 0
    for feature in features:
        if feature.offset < previous_end or feature.end > num_prompt_tokens:
            raise ValueError(
                f"{feature.modality} placeholder runs must lie inside the prompt in order without "
                f"overlapping: [{feature.offset}, {feature.end}) after {previous_end}, prompt of "
                f"{num_prompt_tokens} tokens"
            )
        previous_end = feature.end

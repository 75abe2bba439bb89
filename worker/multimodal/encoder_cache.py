"""The encoder cache: each image's encoder output, computed once and kept while a request still
needs rows of it (its prefill chunks may span several steps; another request may show the same
image). Keyed by `MultiModalFeature.identifier`, the hash of the image's content.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from scheduler.multimodal import MultiModalFeature

EncodeImages = Callable[[list[MultiModalFeature]], list[torch.Tensor]]
"""A model's `embed_images`: one [feature.length, hidden_size] tensor per feature."""


class EncoderCache:
    """Encoder outputs by image identifier, with counters tests and logs read."""

    def __init__(self) -> None:
        self.outputs: dict[str, torch.Tensor] = {}
        """identifier -> [length, hidden_size] encoder output (vision tower + projector)."""
        self.num_encoder_calls = 0
        """`embed_images` calls so far (at most one per step)."""
        self.num_images_encoded = 0
        """Images encoded so far (an image held in the cache is not encoded again)."""

    def retain(self, needed: set[str]) -> None:
        """Drop every output whose identifier is not in `needed`."""
        for identifier in [key for key in self.outputs if key not in needed]:
            del self.outputs[identifier]

    def ensure(self, features: Iterable[MultiModalFeature], encode: EncodeImages) -> None:
        """Encode, in one `encode` call, the features whose output is not held yet."""
        missing: dict[str, MultiModalFeature] = {}
        for feature in features:
            if feature.identifier not in self.outputs:
                missing.setdefault(feature.identifier, feature)
        if not missing:
            return
        outputs = encode(list(missing.values()))
        self.num_encoder_calls += 1
        self.num_images_encoded += len(missing)
        if len(outputs) != len(missing):
            raise RuntimeError(
                f"embed_images gave {len(outputs)} outputs for {len(missing)} images"
            )
        for feature, output in zip(missing.values(), outputs, strict=True):
            if output.dim() != 2 or output.shape[0] != feature.length:
                raise RuntimeError(
                    f"image {feature.identifier[:12]} fills {feature.length} positions but its "
                    f"encoder output has shape {tuple(output.shape)}"
                )
            self.outputs[feature.identifier] = output

    def __getitem__(self, identifier: str) -> torch.Tensor:
        return self.outputs[identifier]

    def __len__(self) -> int:
        return len(self.outputs)

"""Images of a prompt -> the prompt's token IDs and one `MultiModalFeature` per placeholder run.

    image parts / multi_modal_data ─► count (limit_mm_per_prompt) ─► load (cluster.engine.media)
    prompt text with one placeholder per image ─► the model's HF processor (AutoProcessor from
        the model folder, mm_processor_kwargs passed through): placeholders expanded, pixels
    ─► runs of the architecture's placeholder token + its adapter's per-run slices
       (cluster.engine.mm_adapters) ─► MultiModalFeature(offset, length, identifier, data)

A feature's identifier is the sha256 of its encoder inputs (the processed pixels and grids),
which are a function of the image and of every processing option: the same image processed the
same way shares encoder output and prefix-cache entries, anything else never does. The
processor runs under a lock, so callers may process from several threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from cluster.engine.media import MediaConfig, MediaError, check_pixels, load_image
from cluster.engine.mm_adapters import IMAGE_ADAPTERS, EncoderInputs, ImageAdapter
from cluster.openai_api.content_parts import ImageRef
from scheduler.multimodal import MultiModalFeature

if TYPE_CHECKING:
    from cluster.config.engine_args import EngineArgs

logger = logging.getLogger(__name__)

DEFAULT_LIMIT_PER_PROMPT = 999
"""Images per prompt when `limit_mm_per_prompt` names none (vLLM's default)."""
NO_IMAGES = "this model takes no images"
NEEDS_PACKAGE = "its image processor needs a package that is not installed (torchvision)"


@dataclass(frozen=True)
class MultiModalConfig:
    """How a model's images are taken in (from the engine arguments)."""

    max_images_per_prompt: int = DEFAULT_LIMIT_PER_PROMPT
    """`limit_mm_per_prompt["image"]`; 0 turns images off."""
    processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """`mm_processor_kwargs`, passed to every processor call."""
    media: MediaConfig = field(default_factory=MediaConfig)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> MultiModalConfig:
        domains, limits = args.allowed_media_domains, args.limit_mm_per_prompt or {}
        return cls(
            max_images_per_prompt=limits.get("image", DEFAULT_LIMIT_PER_PROMPT),
            processor_kwargs=dict(args.mm_processor_kwargs or {}),
            media=MediaConfig(
                allowed_local_media_path=args.allowed_local_media_path,
                allowed_media_domains=None if domains is None else tuple(domains),
                fetch_timeout_s=args.media_fetch_timeout_s,
                max_media_bytes=args.max_media_bytes,
                max_image_pixels=args.max_image_pixels,
            ),
        )


class MultiModalInputs:
    """One model's image processing (or, with no processor, why it takes no images)."""

    def __init__(
        self,
        processor: Any,
        adapter: ImageAdapter | None,
        config: MultiModalConfig,
        refusal: str | None = None,
    ) -> None:
        self.processor = processor
        self.adapter = adapter
        self.config = config
        self.refusal = NO_IMAGES if processor is None and refusal is None else refusal
        self._lock = threading.Lock()

    @property
    def placeholder_text(self) -> str:
        """What marks an image's place in prompt text (`<start_of_image>`, `<|image_pad|>`)."""
        return str(self.processor.image_token)

    def check_images(self, places: Sequence[str]) -> None:
        """ValueError naming the part when this model takes no images or too many are sent."""
        if not places:
            return
        if self.refusal is not None:
            raise ValueError(f"{places[0]}: {self.refusal}")
        limit = self.config.max_images_per_prompt
        if len(places) > limit:
            raise ValueError(
                f"{places[limit]}: more than {limit} images in one prompt "
                f"(limit_mm_per_prompt={{'image': {limit}}})"
            )

    def load(self, refs: Sequence[ImageRef]) -> list[Image.Image]:
        """The images of `refs`, loaded and checked; ValueError naming the first bad part."""
        self.check_images([ref.where for ref in refs])
        return [self._load_one(ref) for ref in refs]

    def checked_images(self, images: object, where: str) -> list[Image.Image]:
        """`multi_modal_data["image"]` (one PIL image or a list) as a checked list."""
        items = images if isinstance(images, list | tuple) else [images]
        places = [f"{where}[{index}]" for index in range(len(items))]
        self.check_images(places)
        return [self._checked(place, item) for place, item in zip(places, items, strict=True)]

    def process(
        self, text: str, images: Sequence[Image.Image], add_special_tokens: bool
    ) -> tuple[list[int], tuple[MultiModalFeature, ...]]:
        """`text` (one placeholder per image) and `images` -> token IDs and features."""
        assert self.adapter is not None, self.refusal
        found = text.count(self.placeholder_text)
        if found != len(images):
            raise ValueError(
                f"the prompt has {found} image placeholders ({self.placeholder_text!r}) for "
                f"{len(images)} images: give one per image"
            )
        with self._lock:
            outputs = self._run_processor(text, images, add_special_tokens)
        token_ids = [int(token) for token in outputs["input_ids"][0]]
        runs = placeholder_runs(token_ids, self.adapter.placeholder_token_id(self.processor))
        pieces = self.adapter.split(outputs, len(runs))
        features = tuple(
            MultiModalFeature("image", feature_identifier(piece), offset, length, data=piece)
            for (offset, length), piece in zip(runs, pieces, strict=True)
        )
        return token_ids, features

    def _run_processor(
        self, text: str, images: Sequence[Image.Image], add_special_tokens: bool
    ) -> Mapping[str, Any]:
        try:
            outputs: Mapping[str, Any] = self.processor(
                text=[text],
                images=[list(images)],
                return_tensors="pt",
                add_special_tokens=add_special_tokens,
                **self.config.processor_kwargs,
            )
        except Exception as error:  # the processor refuses what it was given: the caller's input
            raise ValueError(f"the image processor failed: {error}") from None
        return outputs

    def _load_one(self, ref: ImageRef) -> Image.Image:
        if ref.url is None:
            return self._checked(ref.where, ref.image)
        try:
            return load_image(ref.url, self.config.media)
        except MediaError as error:
            raise ValueError(f"{ref.where}: {error}") from None

    def _checked(self, where: str, image: object) -> Image.Image:
        if not isinstance(image, Image.Image):
            raise TypeError(f"{where}: must be a PIL image, got {type(image).__name__}")
        try:
            check_pixels(image, self.config.media)
            image.load()
        except MediaError as error:
            raise ValueError(f"{where}: {error}") from None
        except Exception as error:
            raise ValueError(f"{where}: image could not be decoded: {error}") from None
        return image


def placeholder_runs(token_ids: Sequence[int], placeholder: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of `placeholder` in `token_ids`, in order."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token != placeholder:
            continue
        if runs and sum(runs[-1]) == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def feature_identifier(encoder_inputs: EncoderInputs) -> str:
    """sha256 over a run's encoder inputs: names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(encoder_inputs):
        tensor = encoder_inputs[name].contiguous()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def model_architecture(model_path: str) -> str | None:
    """`architectures[0]` of the model folder's config.json (None when it cannot be read)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    architectures = config.get("architectures") or [None]
    return architectures[0] if isinstance(architectures[0], str) else None


def load_multimodal_inputs(model_path: str, config: MultiModalConfig) -> MultiModalInputs:
    """The image processing of the model in `model_path` (AutoProcessor from the folder), or a
    `MultiModalInputs` that refuses images saying why."""
    architecture = model_architecture(model_path)
    adapter = IMAGE_ADAPTERS.get(architecture or "")
    if adapter is None:
        return MultiModalInputs(None, None, config)
    if config.max_images_per_prompt == 0:
        return MultiModalInputs(None, None, config, "images are off (limit_mm_per_prompt)")
    from transformers import AutoProcessor

    try:
        if adapter.load_processor is not None:
            processor = adapter.load_processor(model_path)
        else:
            processor = AutoProcessor.from_pretrained(  # type: ignore[no-untyped-call]
                model_path, local_files_only=True
            )
    except (OSError, ValueError, TypeError) as error:
        logger.warning("%s: no image processor (%s); images are refused", model_path, error)
        return MultiModalInputs(None, None, config, f"{NO_IMAGES}: its folder has no processor")
    except ImportError as error:  # e.g. Gemma 4's and Llama 4's processors without torchvision
        logger.warning(
            "%s: image processor unavailable (%r); images are refused", model_path, error
        )
        return MultiModalInputs(None, None, config, f"{NO_IMAGES} here: {NEEDS_PACKAGE}")
    if not hasattr(processor, "image_processor"):
        return MultiModalInputs(None, None, config, f"{NO_IMAGES}: its folder has no processor")
    return MultiModalInputs(processor, adapter, config)

"""What the input processor needs to know per vision-language architecture.

The model's own HF processor expands each image placeholder of the prompt into a run of
placeholder tokens and returns the encoder inputs of all images batched together. An
`ImageAdapter` says which token those runs are made of and how to cut the batched outputs into
one piece per run (in prompt order). Families add one entry to `IMAGE_ADAPTERS`, keyed by the
checkpoint's `architectures[0]`; a model without an entry takes no images.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cluster.engine.mm_gemma4 import load_gemma4_processor
from cluster.engine.mm_qwen3_5 import load_qwen3_5_processor

ProcessorOutputs = Mapping[str, Any]
"""The HF processor's outputs (`BatchFeature`) for one prompt, tensors batched over images."""
EncoderInputs = dict[str, torch.Tensor]
"""One run's slice of the processor outputs (leading dimension kept), what its encoder reads."""


@dataclass(frozen=True)
class ImageAdapter:
    """How one architecture's processor outputs map to placeholder runs."""

    placeholder_token_id: Callable[[Any], int]
    """processor -> the token the encoder output replaces (the run's token, not the image's
    begin / end markers)."""
    split: Callable[[ProcessorOutputs, int], list[EncoderInputs]]
    """(processor outputs, number of runs) -> each run's encoder inputs, in prompt order."""
    load_processor: Callable[[str], Any] | None = None
    """model folder -> its processor, where `AutoProcessor` cannot build it (None: it can)."""


def split_rows(keys: tuple[str, ...]) -> Callable[[ProcessorOutputs, int], list[EncoderInputs]]:
    """Splitter for processors that give one row of each of `keys` per run (Gemma 3:
    `pixel_values` [runs, 3, H, W])."""

    def split(outputs: ProcessorOutputs, num_runs: int) -> list[EncoderInputs]:
        for key in keys:
            if len(outputs[key]) != num_runs:
                raise ValueError(
                    f"the processor gave {len(outputs[key])} rows of {key} for {num_runs} "
                    "image placeholder runs"
                )
        return [
            {key: outputs[key][run : run + 1].clone() for key in keys} for run in range(num_runs)
        ]

    return split


def split_patches_by_grid(
    patches_key: str = "pixel_values", grid_key: str = "image_grid_thw"
) -> Callable[[ProcessorOutputs, int], list[EncoderInputs]]:
    """Splitter for processors that flatten every image's patches into one tensor
    (Qwen-style: `pixel_values` [sum of t*h*w, dim] with `image_grid_thw` [images, 3])."""

    def split(outputs: ProcessorOutputs, num_runs: int) -> list[EncoderInputs]:
        grids = outputs[grid_key]
        if len(grids) != num_runs:
            raise ValueError(f"the processor gave {len(grids)} image grids for {num_runs} runs")
        counts = [int(torch.prod(grid)) for grid in grids]
        patches = torch.split(outputs[patches_key], counts)
        return [
            {patches_key: patch.clone(), grid_key: grids[run : run + 1].clone()}
            for run, patch in enumerate(patches)
        ]

    return split


def _gemma3_image_token(processor: Any) -> int:
    """`<image_soft_token>`; the processor's own `image_token` is the `<start_of_image>` marker
    each image placeholder expands around."""
    return int(processor.tokenizer.image_token_id)


def _gemma4_image_token(processor: Any) -> int:
    """`<|image|>`: the soft token each image expands to a run of (between its markers)."""
    return int(processor.image_token_id)


def _llama4_patch_token(processor: Any) -> int:
    """`<|patch|>`: each tile of an image (and its global view) is one run of it, the runs
    separated by tile separators and `<|image|>` (ordinary tokens)."""
    return int(processor.tokenizer.convert_tokens_to_ids(processor.img_patch_token))


def _qwen3_5_image_pad(processor: Any) -> int:
    """`<|image_pad|>`: each image expands to a run of it between `<|vision_start|>` and
    `<|vision_end|>` (ordinary tokens), one per merged 2 x 2 patch."""
    return int(processor.image_token_id)


_QWEN3_5 = ImageAdapter(
    placeholder_token_id=_qwen3_5_image_pad,
    split=split_patches_by_grid(),
    load_processor=load_qwen3_5_processor,
)

IMAGE_ADAPTERS: dict[str, ImageAdapter] = {
    "Gemma3ForConditionalGeneration": ImageAdapter(
        placeholder_token_id=_gemma3_image_token, split=split_rows(("pixel_values",))
    ),
    "Gemma4ForConditionalGeneration": ImageAdapter(
        placeholder_token_id=_gemma4_image_token,
        split=split_rows(("pixel_values", "image_position_ids")),
        load_processor=load_gemma4_processor,
    ),
    # one run per tile: `pixel_values` [tiles of all images, 3, tile, tile] in prompt order
    "Llama4ForConditionalGeneration": ImageAdapter(
        placeholder_token_id=_llama4_patch_token, split=split_rows(("pixel_values",))
    ),
    "Qwen3_5ForConditionalGeneration": _QWEN3_5,
    "Qwen3_5MoeForConditionalGeneration": _QWEN3_5,
}

"""Qwen3.5's image processor, built from its model folder without a video processor.

transformers' processor of Qwen3.5 checkpoints (`Qwen3VLProcessor`) requires a video processor,
and video processors require torchvision, which we do not install; we take images only. So the
processor is transformers' own with its image processor (Qwen2-VL's: dynamic resolution within
`min_pixels` / `max_pixels`, patches flattened per image with `image_grid_thw`) and tokenizer
alone: each `<|image_pad|>` of the prompt expands, exactly as there, to one token per merged
patch of its image's grid.
"""

from __future__ import annotations

from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor


class Qwen3_5ImageProcessor(Qwen3VLProcessor):
    """transformers' Qwen3.5 processor whose only parts are the image processor and tokenizer."""

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


def load_qwen3_5_processor(model_path: str) -> Qwen3_5ImageProcessor:
    """The images-only processor of the Qwen3.5 checkpoint in `model_path` (OSError, ValueError
    or TypeError when the folder lacks its image processor or tokenizer)."""
    image_processor = AutoImageProcessor.from_pretrained(  # type: ignore[no-untyped-call]
        model_path, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return Qwen3_5ImageProcessor(  # type: ignore[no-untyped-call]
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
    )

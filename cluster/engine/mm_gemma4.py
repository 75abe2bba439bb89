"""Gemma 4's image processor, built from its model folder without torchvision.

transformers' Gemma 4 processor (`Gemma4Processor`) requires a feature extractor (audio) and a
video processor, video processors require torchvision, which we do not install, and the image
processor a released checkpoint names (`Gemma4ImageProcessor`) is the torchvision one too. We
take images and text only: the processor here is transformers' own with the PIL image processor
(`Gemma4ImageProcessorPil`, read from the folder's image processor config: same resizing within
`max_soft_tokens`, same patches and `image_position_ids`) and the tokenizer alone. Each
`<|image|>` of the prompt expands, exactly as there, to `<|boi|>`, one `<|image|>` soft token per
pooled patch of its image and `<|eoi|>`. Videos and audio are not taken.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, Gemma4ImageProcessorPil, Gemma4Processor
from transformers.processing_utils import ProcessorMixin


class _WithoutAudioAndVideo(ProcessorMixin):
    """Drops the (absent) feature extractor and video processor that `Gemma4Processor.__init__`
    hands on, so that only the image processor and tokenizer become parts."""

    def __init__(
        self,
        *args: Any,
        feature_extractor: None = None,
        video_processor: None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]


class Gemma4ImageProcessor(Gemma4Processor, _WithoutAudioAndVideo):
    """transformers' Gemma 4 processor whose only parts are the image processor and tokenizer
    (its own token attributes, placeholder expansion and outputs)."""

    def __init__(self, image_processor: Any, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(None, image_processor, tokenizer, None, **kwargs)

    @classmethod
    def get_attributes(cls) -> list[str]:
        return ["image_processor", "tokenizer"]


def load_gemma4_processor(model_path: str) -> Gemma4ImageProcessor:
    """The images-only processor of the Gemma 4 checkpoint in `model_path` (OSError, ValueError
    or TypeError when the folder lacks its image processor or tokenizer)."""
    image_processor = Gemma4ImageProcessorPil.from_pretrained(model_path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return Gemma4ImageProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
    )

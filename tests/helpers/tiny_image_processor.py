"""A tiny Gemma 3 processor (word-level tokenizer with Gemma 3's image tokens, 28x28 images,
4 soft tokens per image) saved in a model folder, and images to send it, built offline.

The chat template renders each message as `t1 <content>`, an image part as Gemma 3's
`<start_of_image>` placeholder, and the generation prompt as `t2`, as Gemma 3's template does with
its own words.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import Gemma3ImageProcessorPil, Gemma3Processor, PreTrainedTokenizerFast

GEMMA3_ARCHITECTURE = "Gemma3ForConditionalGeneration"
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_image>", "<end_of_image>"]
IMAGE_TOKEN = "<image_soft_token>"
IMAGE_SIZE = 28
TOKENS_PER_IMAGE = 4
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% for m in messages %}{{ 't1 ' }}"
    "{% if m['content'] is string %}{{ m['content'] + ' ' }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ '<start_of_image> ' }}{% else %}{{ p['text'] + ' ' }}"
    "{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 't2' }}{% endif %}"
)


def save_tiny_gemma3_processor(path: Path, vocab_size: int = 64) -> Gemma3Processor:
    """The processor in `path` (and a config.json naming Gemma 3's VLM architecture when the
    folder has none); word `tN` is token N, the image tokens follow the words."""
    words = [f"t{i}" for i in range(vocab_size - len(SPECIAL_TOKENS) - 1)]
    vocab = {word: index for index, word in enumerate([*words, *SPECIAL_TOKENS, IMAGE_TOKEN])}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="t0",
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": IMAGE_TOKEN,
        },
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    path.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(path)
    config = path / "config.json"
    if not config.exists():
        config.write_text(json.dumps({"architectures": [GEMMA3_ARCHITECTURE]}))
    return processor


def add_chat_template(path: Path) -> None:
    """Give the model folder's tokenizer and processor `CHAT_TEMPLATE` (the file both read)."""
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def random_image(seed: int, width: int = 40, height: int = 30) -> Image.Image:
    """An RGB image of random pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    """`image` as a data:image/png;base64, URL."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_part(url: str) -> dict[str, object]:
    """An OpenAI image_url content part."""
    return {"type": "image_url", "image_url": {"url": url}}

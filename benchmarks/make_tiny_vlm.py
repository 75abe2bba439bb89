"""Write a tiny random Gemma 3 vision-language checkpoint that hybridserve serves with images:
`Gemma3ForConditionalGeneration` (a two-layer SigLIP tower over 56-pixel images, four image
tokens per image, a four-layer text model) with transformers' Gemma 3 processor over a
word-level vocabulary (t0..t252) and a chat template that places each image part. Random
weights: the answers are words of that vocabulary, not language. Run from the repository root
(it uses the tests' model helpers):

    .venv/bin/python -m benchmarks.make_tiny_vlm /tmp/tiny-vlm
    .venv/bin/hybridserve serve --model /tmp/tiny-vlm
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.helpers.tiny_image_processor import add_chat_template
from tests.helpers.tiny_vlm import save_tiny_gemma3_vlm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where to write the checkpoint")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    save_tiny_gemma3_vlm(args.folder)
    add_chat_template(args.folder)
    print(f"wrote a tiny Gemma 3 vision-language checkpoint to {args.folder}")
    print(f"serve it: hybridserve serve --model {args.folder}")


if __name__ == "__main__":
    main()

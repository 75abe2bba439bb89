"""Write a tiny int4 checkpoint that hybridserve serves as it serves a downloaded AWQ, GPTQ or
compressed-tensors W4A16 release: a random Llama (hidden size 256, 4 layers) with a byte-level
tokenizer, its linear layers quantized to 4 bits per group and packed in the chosen format,
with the `quantization_config` those releases carry. The engine reads the format from
config.json and dequantizes once at load. Run from the repository root (it uses the tests'
model and tokenizer helpers):

    .venv/bin/python -m benchmarks.make_quantized_checkpoint /tmp/tiny-gptq --act-order
    .venv/bin/hybridserve generate --model /tmp/tiny-gptq --prompt "Hello" --max-tokens 16
    .venv/bin/hybridserve serve --model /tmp/tiny-gptq

Formats (--format): awq (gemm, zero points), gptq (the default; v1; --symmetric, --act-order
for desc_act), compressed-tensors (pack-quantized; --symmetric, --act-order for actorder group);
--group-size 32, 64 or 128 (default), -1 for one group per row.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.helpers.byte_model import EOS_ID, VOCAB_SIZE, byte_tokenizer
from tests.helpers.quantized_int4_checkpoints import Int4Format, write_int4_checkpoint
from tests.helpers.tiny_models import save_tiny_model

FORMATS = ("awq", "gptq", "compressed-tensors")
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "max_position_embeddings": 1024}


def make_checkpoint(out: Path, fmt: Int4Format, seed: int = 0) -> Path:
    """The tiny Llama of `seed`, quantized in `fmt`, with its tokenizer, in folder `out`."""
    with tempfile.TemporaryDirectory() as scratch:
        plain = Path(scratch)
        save_tiny_model(
            "llama", plain, seed=seed, vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, **SHAPE
        )
        byte_tokenizer().save_pretrained(plain)
        return write_int4_checkpoint(plain, out, fmt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the checkpoint to")
    parser.add_argument("--format", choices=FORMATS, default="gptq")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--symmetric", action="store_true", help="no zero points (not awq)")
    parser.add_argument("--act-order", action="store_true", help="groups in activation order")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.format == "awq" and (args.symmetric or args.act_order):
        parser.error("awq checkpoints have zero points and groups in order")
    fmt = Int4Format(args.format, args.group_size, args.symmetric, args.act_order)
    folder = make_checkpoint(args.out, fmt, args.seed)
    print(f"wrote a {fmt.label} checkpoint to {folder}")
    print(f"run it: hybridserve generate --model {folder} --prompt Hello --max-tokens 16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

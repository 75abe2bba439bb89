"""`hybridserve generate --prompt ...`: each prompt's continuation streamed to stdout.

Also the model and sampling flags `generate` and `chat` share, and the stream writer.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args
from cluster.engine.outputs import RequestOutput
from cluster.llm import LLM
from scheduler.request import SamplingParams


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "generate", help="stream completions of prompts"
    )
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several")
    add_model_flags(parser)
    return parser


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The model, where it runs, sampling and engine flags."""
    parser.add_argument("--model", help="model folder or HF ID (default: the embedded model)")
    parser.add_argument("--address", help="run on a Ray cluster: auto, local or host:port")
    add_sampling_flags(parser)
    add_engine_arg_flags(parser, skip=("model",))


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
    )


def open_llm(args: argparse.Namespace) -> LLM:
    return LLM(args.model, address=args.address, **engine_kwargs_from_args(args))


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Each prompt, then its continuation as it is generated."""
    params = sampling_params(args)
    llm = open_llm(args)
    try:
        for prompt in args.prompt:
            out.write(prompt)
            write_stream(llm.stream(prompt, params), out)
            out.write("\n")
    finally:
        llm.shutdown()
    return 0


def write_stream(stream: Iterator[RequestOutput], out: TextIO) -> str:
    """Write each delta's text as it arrives; the whole text."""
    parts: list[str] = []
    for delta in stream:
        text = "".join(output.text for output in delta.outputs)
        parts.append(text)
        out.write(text)
        out.flush()
    return "".join(parts)

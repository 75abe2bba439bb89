"""`hybridserve generate` and `hybridserve chat`: text streamed to stdout as it is produced."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import TextIO

from cluster.config.engine_flags import engine_kwargs_from_args
from cluster.engine.outputs import RequestOutput
from cluster.llm import LLM
from scheduler.request import SamplingParams


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


def run_generate(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Each prompt, then its continuation as it is generated."""
    params = sampling_params(args)
    llm = open_llm(args)
    try:
        for prompt in args.prompt:
            out.write(prompt)
            _write_stream(llm.stream(prompt, params), out)
            out.write("\n")
    finally:
        llm.shutdown()
    return 0


def run_chat(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """One turn with `--message`, else an interactive chat read from stdin (EOF or /exit ends)."""
    params = sampling_params(args)
    llm = open_llm(args)
    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    try:
        for message in [args.message] if args.message else _read_turns(out):
            conversation.append({"role": "user", "content": message})
            reply = _write_stream(llm.stream_chat(conversation, params), out)
            out.write("\n")
            conversation.append({"role": "assistant", "content": reply})
    finally:
        llm.shutdown()
    return 0


def _read_turns(out: TextIO) -> Iterator[str]:
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        if line.strip():
            yield line.strip()


def _write_stream(stream: Iterator[RequestOutput], out: TextIO) -> str:
    """Write each delta's text as it arrives; the whole text."""
    parts: list[str] = []
    for delta in stream:
        text = "".join(output.text for output in delta.outputs)
        parts.append(text)
        out.write(text)
        out.flush()
    return "".join(parts)

"""`hybridserve chat`: talk with a model through its chat template, replies streamed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from cluster.cli.generate import add_model_flags, open_llm, sampling_params, write_stream


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "chat", help="chat with the model (interactive, or --message)"
    )
    parser.add_argument("--message", help="send one message, print the reply and exit")
    parser.add_argument("--system", help="a system message to start the conversation with")
    add_model_flags(parser)
    return parser


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """One turn with `--message`, else an interactive chat read from stdin (EOF or /exit ends)."""
    params = sampling_params(args)
    llm = open_llm(args)
    conversation: list[dict[str, str]] = []
    if args.system:
        conversation.append({"role": "system", "content": args.system})
    try:
        for message in [args.message] if args.message else _read_turns(out):
            conversation.append({"role": "user", "content": message})
            reply = write_stream(llm.stream_chat(conversation, params), out)
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

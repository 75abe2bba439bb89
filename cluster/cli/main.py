"""The `hybridserve` parser and dispatch: each subcommand's module adds its parser and runs it.

`hybridserve generate --prompt "..."` streams a completion (the embedded default model when no
`--model` is given; in-process, or through a Ray cluster with `--address`); `hybridserve chat`
talks with the model's chat template; `hybridserve serve` runs the OpenAI API on Ray Serve;
`hybridserve batch` is `python -m cluster.batch` (Ray Data); `hybridserve run-batch -i IN -o OUT`
is vLLM's run-batch (OpenAI batch lines, in-process); `hybridserve replay TRACE.json ...`
is `python -m scheduler.replay`; `hybridserve config validate FILE.yaml` checks a serving config
without starting anything. Errors are reported as `cluster.cli.errors` says.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from cluster.cli.errors import EXIT_USAGE, run_reporting

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
SUBCOMMANDS = ("generate", "chat", "serve", "batch", "run-batch", "replay", "config")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_log_level(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """`--log-level`, accepted before or after the subcommand."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="WARNING" if top else argparse.SUPPRESS,
        help="logging level (default: WARNING)",
    )


def subcommand(name: str) -> ModuleType:
    """The module of subcommand `name` (`add_parser(subparsers)`, `run(args)`)."""
    return importlib.import_module(f"cluster.cli.{name.replace('-', '_')}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridserve", description=__doc__.splitlines()[0])
    add_log_level(parser, top=True)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMANDS:
        subcommand(name).add_parser(subparsers)
    for choice in subparsers.choices.values():
        add_log_level(choice)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hybridserve` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level)
    run = subcommand(args.command).run
    return run_reporting(args.command, lambda: int(run(args)))


if __name__ == "__main__":
    sys.exit(main())

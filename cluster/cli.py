"""The `hybridserve` command: generation and chat, serving, batch runs, replay, config checks.

`hybridserve generate --prompt "..."` streams a completion (the embedded default model when no
`--model` is given; in-process, or through a Ray cluster with `--address`); `hybridserve chat`
talks with the model's chat template; `hybridserve serve` runs the OpenAI API on Ray Serve
(`cluster.serve_cli`); `hybridserve batch` is `python -m cluster.batch` (Ray Data);
`hybridserve replay TRACE.json ...` is `python -m scheduler.replay`; `hybridserve config validate
FILE.yaml` checks a serving config without starting anything. Errors (bad input, a cluster
that cannot be reached, a deployment that cannot be placed or fails to start) are one line on
stderr (exit 2); Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from cluster.serve_session import DeployFailedError
from scheduler import replay

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """`--log-level` is accepted before or after the subcommand."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="WARNING" if top else argparse.SUPPRESS,
        help="logging level (default: WARNING)",
    )


def _add_model_commands(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    from cluster.cli_generate import add_sampling_flags
    from cluster.config.engine_flags import add_engine_arg_flags

    generate = subparsers.add_parser("generate", help="stream completions of prompts")
    generate.add_argument("--prompt", action="append", required=True, help="repeat for several")
    chat = subparsers.add_parser("chat", help="chat with the model (interactive, or --message)")
    chat.add_argument("--message", help="send one message, print the reply and exit")
    chat.add_argument("--system", help="a system message to start the conversation with")
    for parser in (generate, chat):
        _add_common(parser, top=False)
        parser.add_argument("--model", help="model folder or cached HF ID (default: embedded)")
        parser.add_argument("--address", help="run on a Ray cluster: auto, local or ray://...")
        add_sampling_flags(parser)
        add_engine_arg_flags(parser, skip=("model",))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridserve", description=__doc__.splitlines()[0])
    _add_common(parser, top=True)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_model_commands(subparsers)
    replay_parser = subparsers.add_parser("replay", help="replay KV cache traces (no model)")
    replay_parser.add_argument("files", nargs="+", metavar="FILE.json")
    config_commands = subparsers.add_parser("config", help="check serving config files")
    actions = config_commands.add_subparsers(dest="action", required=True, parser_class=_Parser)
    validate = actions.add_parser(
        "validate", help="validate an LLMConfig, LLMServingArgs or Serve config YAML file"
    )
    validate.add_argument("file", metavar="FILE.yaml")
    for sub in (replay_parser, config_commands, validate):
        _add_common(sub, top=False)
    from cluster.serve_cli import add_serve_parser

    _add_common(add_serve_parser(subparsers), top=False)
    from cluster.batch import __main__ as batch_main

    batch_parser = subparsers.add_parser("batch", help="run a JSONL file of requests on Ray Data")
    batch_main.add_batch_arguments(batch_parser)
    _add_common(batch_parser, top=False)
    return parser


def _run_config_validate(path: str) -> int:
    from cluster.config import validate_config_file

    try:
        model_ids = validate_config_file(path)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    sys.stdout.write(f"ok: {len(model_ids)} model(s): {', '.join(model_ids)}\n")
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "replay":
        return replay.main(args.files)
    if args.command == "config":
        return _run_config_validate(args.file)
    if args.command == "batch":
        from cluster.batch import __main__ as batch_main

        return batch_main.run_or_report(args)
    if args.command == "serve":
        from cluster.serve_cli import run_serve

        return run_serve(args)
    from cluster import cli_generate

    runner = cli_generate.run_chat if args.command == "chat" else cli_generate.run_generate
    return runner(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hybridserve` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level)
    try:
        return _dispatch(args)
    except (ValueError, TypeError, ConnectionError, TimeoutError, DeployFailedError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        sys.stderr.write(f"hybridserve {args.command}: error: {first_line}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""`hybridserve batch` (also `python -m cluster.batch`): run a JSONL file of requests on Ray.

Exit status: 0 when every row succeeded (or with `--continue-on-error`), 1 when a row errored or
the run failed (a replica could not start), 2 for a usage error (bad flag, missing input, output
already there without `--resume`).
The last line on stdout is the run's summary.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cluster.batch.openai_rows import OUTPUT_FORMATS
from cluster.batch.runner import BatchFailed, BatchOptions, run_batch
from cluster.cli.errors import EXIT_FAILED, EXIT_OK, run_reporting
from cluster.config.engine_args import EngineArgs, validate_engine_kwargs
from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args
from cluster.config.errors import format_validation_error


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "batch", help="run a JSONL file of requests on Ray Data"
    )
    add_batch_arguments(parser)
    return parser


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch flags, engine flags included."""
    parser.add_argument("--input", required=True, type=Path, help="JSONL file of requests")
    parser.add_argument(
        "--output", required=True, type=Path, help="JSONL file of results (one row per input row)"
    )
    parser.add_argument("--model", help="local model folder (default: the config's, or embedded)")
    parser.add_argument("--config", type=Path, help="LLMConfig YAML (model and engine_kwargs)")
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas (actor pool)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per replica call")
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS or local)")
    parser.add_argument(
        "--continue-on-error", action="store_true", help="exit 0 even when some rows errored"
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the output's finished rows, run the others"
    )
    parser.add_argument(
        "--output-format",
        choices=OUTPUT_FORMATS,
        default="openai",
        help="openai: OpenAI input lines come back as OpenAI batch output lines (Ray Data LLM "
        "rows keep their columns); columns: Ray Data LLM columns for every line",
    )
    add_engine_arg_flags(parser, skip=("model",))


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """Engine arguments: the config file's, then --model and the engine flags on top."""
    kwargs: dict[str, object] = {}
    if args.config is not None:
        from cluster.config import LLMConfig

        try:
            config = LLMConfig.from_file(args.config)
        except ValidationError as error:
            raise ValueError(f"{args.config}: {format_validation_error(error)}") from None
        kwargs = config.engine_args().model_dump()
    if args.model is not None:
        kwargs["model"] = args.model
    kwargs.update(engine_kwargs_from_args(args))
    return validate_engine_kwargs(kwargs)


def run(args: argparse.Namespace) -> int:
    """Run the batch the parsed flags describe; the exit status (1: rows errored or the run
    failed; the finished rows stay in the output for `--resume`)."""
    options = BatchOptions(
        input=args.input,
        output=args.output,
        engine_args=engine_args_from(args),
        replicas=args.replicas,
        batch_size=args.batch_size,
        continue_on_error=args.continue_on_error,
        resume=args.resume,
        address=args.address,
        output_format=args.output_format,
    )
    try:
        summary = run_batch(options)
    except BatchFailed as error:
        sys.stdout.write(f"batch: failed: {error}; finished rows are in {args.output} (--resume)\n")
        return EXIT_FAILED
    sys.stdout.write(summary.line() + "\n")
    sys.stdout.flush()
    return EXIT_OK if summary.errored == 0 or options.continue_on_error else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cluster.batch`: the same as `hybridserve batch`."""
    parser = argparse.ArgumentParser(prog="python -m cluster.batch", description=__doc__)
    add_batch_arguments(parser)
    args = parser.parse_args(argv)
    return run_reporting("batch", lambda: run(args))

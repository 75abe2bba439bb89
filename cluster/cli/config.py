"""`hybridserve config validate FILE.yaml`: check a serving config without starting anything."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "config", help="check serving config files"
    )
    actions = parser.add_subparsers(dest="action", required=True, parser_class=type(parser))
    validate = actions.add_parser(
        "validate", help="validate an LLMConfig, LLMServingArgs or Serve config YAML file"
    )
    validate.add_argument("file", metavar="FILE.yaml")
    from cluster.cli.main import add_log_level

    add_log_level(validate)
    return parser


def run(args: argparse.Namespace) -> int:
    from cluster.config import validate_config_file

    try:
        model_ids = validate_config_file(args.file)
    except ValueError as error:
        raise ValueError(f"{args.file}: {error}") from None
    sys.stdout.write(f"ok: {len(model_ids)} model(s): {', '.join(model_ids)}\n")
    return 0

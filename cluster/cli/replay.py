"""`hybridserve replay TRACE.json ...`: `python -m scheduler.replay` (no model, no Ray)."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler import replay


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "replay", help="replay KV cache traces (no model)"
    )
    parser.add_argument("files", nargs="+", metavar="FILE.json")
    return parser


def run(args: argparse.Namespace) -> int:
    return replay.main(args.files)

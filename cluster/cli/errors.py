"""One rule for every subcommand: which errors are one line on stderr, and the exit codes.

Bad input, a cluster that cannot be reached and a deployment that cannot be placed or fails to
start are the user's to fix: one line `hybridserve CMD: error: ...`, exit 2. Ctrl-C exits 130.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from pydantic import ValidationError

from cluster.config.errors import format_validation_error

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class StartupFailedError(RuntimeError):
    """Something the command started could not start (the message says what and why)."""


ONE_LINE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    ConnectionError,
    TimeoutError,
    StartupFailedError,
)


def run_reporting(command: str, run: Callable[[], int]) -> int:
    """`run()`'s exit code, or the exit code of the error it raised (reported in one line)."""
    try:
        return run()
    except ValidationError as error:
        return report(command, format_validation_error(error))
    except ONE_LINE_ERRORS as error:
        return report(command, first_line(error))
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return EXIT_INTERRUPTED


def report(command: str, message: str) -> int:
    sys.stderr.write(f"hybridserve {command}: error: {message}\n")
    return EXIT_USAGE


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)

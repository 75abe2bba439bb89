"""The batch output: one JSONL file, owned and appended to by the driver only.

Each finished row is written as one line and flushed at once, so an interrupted run leaves every
finished row on disk (at worst a partial last line). `--resume` reads the file back: complete
rows without an `error` (OpenAI lines: `"error": null`) are kept and their IDs skipped; errored
rows and a partial last line are dropped (rewritten atomically) and run again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from cluster.batch.rows import row_key

ID_KEYS = ("custom_id", "id")


def _row_id_key(row: dict[str, Any]) -> str | None:
    for key in ID_KEYS:
        if key in row:
            return row_key(row[key])
    return None


def is_error_row(row: dict[str, Any]) -> bool:
    """A column row with `error`, or an OpenAI output line whose `error` is set."""
    return row.get("error") is not None


def generated_tokens(row: dict[str, Any]) -> int:
    """Tokens a successful row generated (columns, or an OpenAI line's usage)."""
    if "num_generated_tokens" in row:
        return int(row["num_generated_tokens"])
    usage = (row.get("response") or {}).get("body", {}).get("usage") or {}
    return int(usage.get("completion_tokens", 0))


def prepare_output(path: Path, resume: bool) -> set[str]:
    """Make `path` ready for appending; the IDs of the rows already done (resume only).

    Without `resume` the file must not exist yet (or be empty): ValueError otherwise.
    """
    if path.is_dir():
        raise ValueError(f"--output {path} is a directory; give a file path (out.jsonl)")
    if not path.exists() or path.stat().st_size == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return set()
    if not resume:
        raise ValueError(
            f"--output {path} already exists: pass --resume to continue it, or remove it"
        )
    kept: list[str] = []
    done: set[str] = set()
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # the partial last line of an interrupted run
        key = _row_id_key(row) if isinstance(row, dict) else None
        if key is None or is_error_row(row):
            continue
        done.add(key)
        kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
    return done


class OutputWriter:
    """Appends rows to the output file, one flushed line each, and counts them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self.ok = 0
        self.errored = 0
        self.generated_tokens = 0

    def write(self, row_json: str) -> None:
        row = json.loads(row_json)
        if is_error_row(row):
            self.errored += 1
        else:
            self.ok += 1
            self.generated_tokens += generated_tokens(row)
        self._file.write(row_json + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

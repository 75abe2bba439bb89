"""`hybridserve run-batch`: an OpenAI batch file through one in-process model server.

The lines run through the same `LLMServer` the Serve app uses (so a line gets exactly the body
`/v1/chat/completions` or `/v1/completions` would answer: structured outputs, tools and
`model: "base:adapter"` LoRA adapters included), in prefix groups (`cluster.serve.batch_dispatch`).
Each finished line is appended to `OUTPUT.partial` at once; at the end the lines are written to
the output in input order (successes and errors in one file, as `vllm run-batch` does). A run
that is interrupted resumes from `OUTPUT.partial`: its finished lines are kept, never run again.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.openai_api.batch_protocol import (
    BATCH_PRIORITY,
    BatchLine,
    failure_line,
    invalid_line,
    is_success,
    read_batch_lines,
    success_line,
)
from cluster.openai_api.protocol import ErrorResponse
from cluster.serve.batch_dispatch import Order, dispatch


@dataclass(frozen=True)
class RunBatchSummary:
    output: Path
    ok: int
    errored: int
    resumed: int
    seconds: float

    def line(self) -> str:
        resumed = f", {self.resumed} lines kept from an earlier run" if self.resumed else ""
        return (
            f"run-batch: {self.ok} lines ok, {self.errored} lines errored{resumed} "
            f"in {self.seconds:.1f} s -> {self.output}"
        )


def partial_path(output: Path, tmp_dir: Path | None) -> Path:
    """Where the finished lines go while the run lasts (`--output-tmp-dir`, else by the output)."""
    folder = tmp_dir if tmp_dir is not None else output.parent
    return folder / f"{output.name}.partial"


def read_partial(path: Path) -> dict[int, dict[str, Any]]:
    """The lines an earlier run finished, by input index (a torn last line is dropped)."""
    finished: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return finished
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:
            continue
        finished.setdefault(int(entry["index"]), entry["line"])
    return finished


class LineRunner:
    """Sends batch lines to an in-process `LLMServer`."""

    def __init__(self, server: Any) -> None:
        self.server = server

    async def send(self, line: BatchLine) -> dict[str, Any]:
        request = line.request()
        request = request.model_copy(update={"priority": request.priority + BATCH_PRIORITY})
        request_id = f"batch-{line.index}"
        items = self.server.generate(request, request_id, False)
        item: Any = await items.__anext__()
        await items.aclose()
        if isinstance(item, ErrorResponse):
            return failure_line(line.custom_id, request_id, item.error, item.status)
        return success_line(line.custom_id, request_id, item.model_dump(mode="json"))


async def run_lines(
    server: Any, lines: list[BatchLine], partial: Path, window: int, order: Order = "prefix"
) -> dict[int, dict[str, Any]]:
    """Every line's output line (by index), appending each to `partial` as it finishes."""
    finished = read_partial(partial)
    partial.parent.mkdir(parents=True, exist_ok=True)
    with partial.open("a", encoding="utf-8") as log:
        if log.tell() > 0:
            log.write("\n")  # after a torn last line, the next entry starts on its own line

        def done(line: BatchLine, output_line: dict[str, Any]) -> None:
            finished[line.index] = output_line
            log.write(json.dumps({"index": line.index, "line": output_line}) + "\n")
            log.flush()

        todo = [line for line in lines if line.index not in finished]
        for line in todo:
            if line.error is not None:
                done(line, invalid_line(line, f"batch-{line.index}"))
        runnable = [line for line in todo if line.error is None]
        await dispatch(runnable, LineRunner(server).send, done, window, order)
    return finished


def write_output(output: Path, lines: list[BatchLine], finished: dict[int, dict[str, Any]]) -> None:
    """The output lines in input order, written aside then renamed."""
    aside = output.with_name(output.name + ".writing")
    aside.write_text("".join(json.dumps(finished[line.index]) + "\n" for line in lines))
    os.replace(aside, output)


def run_openai_batch(
    server: Any, input_path: Path, output: Path, tmp_dir: Path | None, window: int
) -> RunBatchSummary:
    """Run the input file's lines through `server`; the output in input order."""
    start = time.perf_counter()
    lines = read_batch_lines(input_path.read_text(encoding="utf-8"))
    partial = partial_path(output, tmp_dir)
    resumed = len(read_partial(partial))
    finished = asyncio.run(run_lines(server, lines, partial, window))
    write_output(output, lines, finished)
    partial.unlink()
    ok = sum(1 for line in lines if is_success(finished[line.index]))
    return RunBatchSummary(output, ok, len(lines) - ok, resumed, time.perf_counter() - start)

"""The batch runner on a local Ray instance: rows equal `LLM.generate`, replicas agree, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.batch import BatchOptions, run_batch
from cluster.config import validate_engine_kwargs
from tests.ray.batch_cases import (
    ENGINE_KWARGS,
    BatchModel,
    check_output,
    read_rows,
    row_id,
    write_input,
)

pytestmark = pytest.mark.ray
# Two engine replicas (one CPU each, `check_pool_fits`) plus their ranks' bundles.
RAY_CPUS = 4


def _options(model: Path, tmp_path: Path, replicas: int = 1, **kwargs: object) -> BatchOptions:
    args = validate_engine_kwargs({"model": str(model), **ENGINE_KWARGS})
    return BatchOptions(
        input=write_input(tmp_path / "in.jsonl"),
        output=tmp_path / "out.jsonl",
        engine_args=args,
        replicas=replicas,
        batch_size=4,
        **kwargs,  # type: ignore[arg-type]
    )


def test_two_replicas_give_llm_generate_tokens_and_resume_runs_only_missing_rows(
    ray_cluster, batch_model: BatchModel, tmp_path: Path
) -> None:
    model, expected = batch_model
    options = _options(model, tmp_path, replicas=2)
    summary = run_batch(options)
    assert (summary.ok, summary.errored, summary.skipped) == (5, 3, 0)
    rows = read_rows(options.output)
    assert [row_id(row) for row in rows] == ["p", "m", 2, "oc", "ocmp", 5, "bad-params", "too-long"]
    check_output(rows, expected)
    assert summary.generated_tokens == sum(len(tokens) for tokens in expected.values())

    # A partial output: two finished rows (marked, so a re-run would show), an error row and a
    # half-written line. --resume keeps the marked rows and runs every other row.
    kept = [dict(rows[0], generated_text="KEPT"), dict(rows[3], generated_text="KEPT")]
    partial = [*map(json.dumps, kept), json.dumps({"id": "m", "error": "engine died"}), '{"id": 2']
    options.output.write_text("\n".join(partial))
    resumed = run_batch(_options(model, tmp_path, replicas=1, resume=True))
    assert (resumed.ok, resumed.errored, resumed.skipped) == (3, 3, 2)
    rows_after = read_rows(options.output)
    assert rows_after[:2] == kept
    check_output([*rows[:1], *rows[3:4], *rows_after[2:]], expected)

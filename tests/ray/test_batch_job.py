"""`ray job submit --working-dir . -- python -m cluster.batch ...` against a `ray start` head.

One job runs the mixed input with --continue-on-error: it succeeds and its rows equal
`LLM.generate` (test_batch_runner checks that two replicas give them too). A second job resumes
that output without --continue-on-error: it runs only the errored rows again, which fail again,
so the job fails, and the finished rows are kept.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers.ray_head import RAY, RayHead, ray_head
from tests.ray.batch_cases import (
    ENGINE_FLAGS,
    BatchModel,
    check_output,
    read_rows,
    write_input,
)

pytestmark = pytest.mark.ray
REPO_ROOT = Path(__file__).resolve().parents[2]


def _submit(head: RayHead, *batch_args: str) -> subprocess.CompletedProcess[str]:
    command = [
        str(RAY),
        "job",
        "submit",
        "--address",
        head.dashboard_url,
        "--working-dir",
        ".",
        "--",
        "python",
        "-m",
        "cluster.batch",
        *batch_args,
        *ENGINE_FLAGS,
    ]
    return subprocess.run(
        command, cwd=REPO_ROOT, env=head.client_env, capture_output=True, text=True, timeout=400
    )


def test_batch_job_succeeds_with_continue_on_error_and_a_resumed_job_fails_on_bad_rows(
    batch_model: BatchModel, tmp_path: Path
) -> None:
    model, expected = batch_model
    source, output = write_input(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = ["--input", str(source), "--output", str(output), "--model", str(model)]
    with ray_head(tmp_path) as head:
        first = _submit(head, *args, "--continue-on-error")
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        assert "batch: 5 rows ok, 3 rows errored" in first.stdout
        rows = read_rows(output)
        check_output(rows, expected)

        second = _submit(head, *args, "--resume")
        assert second.returncode != 0, second.stdout[-3000:]
        assert "batch: 0 rows ok, 3 rows errored, 5 rows already done" in second.stdout
    rows_after = read_rows(output)
    assert rows_after[:5] == rows[:5]
    check_output(rows_after, expected)

"""`hybridserve run-batch`: OpenAI batch lines through the in-process model server.

The output is checked field by field against OpenAI's batch output format, bodies parsed with
the `openai` client's own types, answers against the offline `LLM` (greedy, the word-level
tokenizer: equal text is equal tokens); a run interrupted after some lines resumes without
running them again. The Ray Data batch replica (`ray job submit` runs) writes the same lines
under `--output-format openai`, and its columns under `columns`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from cluster.batch.replica import EngineReplica
from cluster.batch.rows import parse_line
from cluster.cli.main import main
from cluster.config import validate_engine_kwargs
from cluster.llm import LLM
from scheduler.request import SamplingParams
from tests.helpers.serve_app import save_tiny_served_model

PROMPTS = ["t5 t17 t33 t2 t9", "t100 t3", "t7 t7 t7 t8 t9 t10 t11"]
ENGINE = ["--dtype", "float32", "--block-size", "4", "--kv-cache-memory-bytes", str(8 << 20)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_served_model(tmp_path_factory.mktemp("run-batch-model"))


def _lines() -> list[str]:
    lines = [
        {
            "custom_id": f"cmpl-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0},
        }
        for i, prompt in enumerate(PROMPTS)
    ]
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "t9 t10"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    lines.append(
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat}
    )
    texts = [json.dumps(line) for line in lines]
    return [*texts[:2], '{"custom_id": "broken", ', *texts[2:]]


def _run(model_dir: Path, source: Path, output: Path) -> int:
    argv = ["run-batch", "-i", str(source), "-o", str(output), "--model", str(model_dir)]
    return main([*argv, "--served-model-name", "tiny", *ENGINE])


def _check_format(line: dict[str, Any]) -> None:
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_")
    assert set(line["response"]) == {"status_code", "request_id", "body"}


def test_run_batch_writes_openai_output_lines(model_dir: Path, tmp_path: Path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(_lines()) + "\n")
    assert _run(model_dir, source, output) == 1  # one line errored
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["cmpl-0", "cmpl-1", "line-3", "cmpl-2", "chat"]
    reference = LLM(str(model_dir), block_size=4, kv_cache_memory_bytes=8 << 20)
    expected = [
        r.outputs[0].text
        for r in reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5))
    ]
    reference.shutdown()
    for line, text in zip([lines[0], lines[1], lines[3]], expected, strict=True):
        _check_format(line)
        assert line["error"] is None
        assert line["response"]["status_code"] == 200
        body = Completion.model_validate(line["response"]["body"])
        assert body.choices[0].text == text
        assert body.model == "tiny"
        assert body.usage is not None
        assert body.usage.completion_tokens == 5
    chat = ChatCompletion.model_validate(lines[4]["response"]["body"])
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None
    broken = lines[2]
    _check_format(broken)
    assert broken["response"]["status_code"] == 400
    assert broken["error"]["line"] == 3
    assert "not valid JSON" in broken["error"]["message"]
    assert broken["response"]["body"]["error"]["message"] == broken["error"]["message"]
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_an_interrupted_run_resumes_without_running_finished_lines(
    model_dir: Path, tmp_path: Path
) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(_lines()) + "\n")
    kept = {"id": "batch_req_kept", "custom_id": "cmpl-1", "response": None, "error": None}
    partial = tmp_path / "out.jsonl.partial"
    partial.write_text(json.dumps({"index": 1, "line": kept}) + '\n{"index": 3, "li')  # torn
    _run(model_dir, source, output)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert lines[1] == kept  # not run again
    assert [line["custom_id"] for line in lines] == ["cmpl-0", "cmpl-1", "line-3", "cmpl-2", "chat"]
    assert lines[3]["response"]["status_code"] == 200  # the torn one ran


def _replica_rows(replica: EngineReplica, texts: list[str]) -> list[dict[str, Any]]:
    records = [parse_line(index, text).to_record()["item"] for index, text in enumerate(texts)]
    rows = replica({"item": np.array(records, dtype=object)})["row"]
    return [json.loads(row) for row in rows]


def _without_times(line: dict[str, Any]) -> dict[str, Any]:
    """The line without its own ID and the body's creation time (the rest must agree)."""
    response = line["response"]
    body = {key: value for key, value in response["body"].items() if key != "created"}
    return {**line, "id": None, "response": {**response, "body": body}}


def test_batch_replica_writes_run_batch_lines_or_columns(model_dir: Path, tmp_path: Path) -> None:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    texts = _lines()
    source.write_text("\n".join(texts) + "\n")
    _run(model_dir, source, output)
    expected = [json.loads(line) for line in output.read_text().splitlines()]
    kwargs = {"dtype": "float32", "block_size": 4, "kv_cache_memory_bytes": 8 << 20}
    engine_args = validate_engine_kwargs(
        {"model": str(model_dir), "distributed_executor_backend": "uni", **kwargs}
    )
    replica = EngineReplica(engine_args, output_format="openai")
    try:
        lines = _replica_rows(replica, texts)
        replica.output_format = "columns"
        columns = _replica_rows(replica, texts)
    finally:
        replica.__del__()
    good = [0, 1, 3, 4]
    for index in good:
        _check_format(lines[index])
        assert _without_times(lines[index]) == _without_times(expected[index])
    assert lines[2] == columns[2]  # not JSON at all: the column format's error row in both
    assert lines[2]["id"] == 2
    assert "not valid JSON" in lines[2]["error"]
    for index in good[:3]:
        body = lines[index]["response"]["body"]
        assert columns[index]["generated_text"] == body["choices"][0]["text"]
        assert columns[index]["num_generated_tokens"] == body["usage"]["completion_tokens"]

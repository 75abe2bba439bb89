"""Batch input parsing, output rows, resume bookkeeping and engine flags (no Ray, no model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cluster.batch.output import OutputWriter, prepare_output
from cluster.batch.rows import openai_request, parse_line
from cluster.batch.runner import BatchSummary, read_items
from cluster.config.engine_flags import add_engine_arg_flags, engine_kwargs_from_args
from cluster.openai_api.sampling import to_sampling_params
from scheduler.request import SamplingParams


def test_row_format_keeps_the_id_and_checks_sampling_params() -> None:
    item = parse_line(0, '{"id": "a", "prompt": "hi", "sampling_params": {"max_tokens": 3}}')
    assert (item.id_key, item.row_id, item.error) == ("id", "a", None)
    assert item.request is not None
    assert item.request["prompt"] == "hi"
    assert item.request["sampling_params"]["max_tokens"] == 3


def test_a_row_without_id_is_named_by_its_line_index() -> None:
    item = parse_line(7, '{"prompt_token_ids": [1, 2]}')
    assert (item.id_key, item.row_id) == ("id", 7)


def test_openai_batch_lines_keep_the_body_the_http_models_accept() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        "max_completion_tokens": 5,
        "temperature": 0,
        "top_p": 0.5,
        "stop": ["."],
        "presence_penalty": 0.5,
    }
    chat = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    item = parse_line(0, json.dumps(chat))
    assert (item.id_key, item.row_id, item.error) == ("custom_id", "c1", None)
    assert item.request == {"url": "/v1/chat/completions", "body": body}
    request = openai_request("/v1/chat/completions", body)
    assert to_sampling_params(request, 5) == SamplingParams(
        max_tokens=5, temperature=0, top_p=0.5, stop=(".",), presence_penalty=0.5
    )
    completion = {"custom_id": 3, "url": "/v1/completions", "body": {"prompt": "t1"}}
    assert parse_line(1, json.dumps(completion)).request == {
        "url": "/v1/completions",
        "body": {"prompt": "t1"},
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 4 is not valid JSON"),
        ("[1, 2]", "line 4 must be a JSON object"),
        ('{"id": 1}', "exactly one of 'prompt', 'messages'"),
        ('{"prompt": "a", "messages": []}', "exactly one of"),
        ('{"prompt": "a", "sampling_params": {"temprature": 0}}', "did you mean 'temperature'"),
        ('{"prompt": "a", "sampling_params": {"top_p": 2}}', "top_p must be in (0, 1]"),
        ('{"prompt": "a", "sampling_params": {"n": 2}}', "n must be 1 in batch runs"),
        ('{"prompt": "a", "sampling_params": []}', "sampling_params must be an object"),
        ('{"promt": "a"}', "unknown row key 'promt' (did you mean 'prompt'?)"),
        ('{"custom_id": 1, "url": "/v1/embeddings", "body": {}}', "url must be one of"),
        ('{"custom_id": 1, "url": "/v1/completions", "body": {"messages": []}}', "prompt"),
        ('{"custom_id": 1, "body": {"messages": [{"role": "user"}], "tools": [{}]}}', "tools"),
        ('{"custom_id": 1, "body": {"messages": [{"role": "user"}], "stream": true}}', "stream"),
        ('{"custom_id": 1, "body": {"messages": [{"role": "user"}], "top_p": 2}}', "top_p"),
    ],
)
def test_bad_lines_become_error_items(line: str, message: str) -> None:
    item = parse_line(3, line)
    assert item.request is None
    assert item.error is not None
    assert message in item.error


def test_duplicate_ids_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        '{"id": 1, "prompt": "a"}\n\n{"id": 1, "prompt": "b"}\n{"id": 2, "prompt": "c"}\n'
    )
    items, skipped = read_items(path, done={"2"})
    assert skipped == 1
    assert [(item.index, item.error) for item in items] == [(0, None), (2, "duplicate id 1")]


def test_resume_keeps_finished_rows_and_drops_errors_and_partial_lines(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    ok = {"id": "a", "generated_text": "x", "num_generated_tokens": 1}
    lines = [json.dumps(ok), json.dumps({"custom_id": 5, "error": "boom"}), '{"id": "c", "gen']
    out.write_text("\n".join(lines))
    with pytest.raises(ValueError, match="pass --resume"):
        prepare_output(out, resume=False)
    assert prepare_output(out, resume=True) == {'"a"'}
    assert out.read_text() == json.dumps(ok) + "\n"
    writer = OutputWriter(out)
    writer.write(json.dumps({"custom_id": 5, "error": "again"}))
    writer.close()
    assert (writer.ok, writer.errored) == (0, 1)
    assert len(out.read_text().splitlines()) == 2


def test_summary_line_names_rows_tokens_and_output() -> None:
    line = BatchSummary(Path("out.jsonl"), 998, 2, 0, 51234, 12.3).line()
    assert line == (
        "batch: 998 rows ok, 2 rows errored, 51234 tokens generated in 12.3 s "
        "(4165 tokens/s) -> out.jsonl"
    )
    assert "passed" not in line


def test_engine_flags_are_generated_from_engine_args() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arg_flags(parser, skip=("model",))
    args = parser.parse_args(["--max-model-len", "64", "--no-enable-prefix-caching"])
    assert engine_kwargs_from_args(args) == {"max_model_len": 64, "enable_prefix_caching": False}
    assert engine_kwargs_from_args(parser.parse_args([])) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "x"])

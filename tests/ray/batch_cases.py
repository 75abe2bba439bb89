"""The input file, tiny model and expected outputs shared by the batch tests.

The expected tokens come from the offline `LLM` (greedy) on the same model, so the batch path
(Ray Data, replicas, row parsing, chat rendering) must reproduce them exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from cluster import LLM, SamplingParams
from tests.helpers.tiny_models import save_tiny_model
from tests.helpers.word_tokenizer import save_word_tokenizer

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 22), "--block-size", "4"]
ENGINE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_memory_bytes": 1 << 22,
    "block_size": 4,
}
CHAT = [{"role": "user", "content": "t7 t8 t9"}]
GOOD_ROWS: list[dict[str, Any]] = [
    {
        "id": "p",
        "prompt": "t5 t17 t33 t2 t9",
        "sampling_params": {"temperature": 0, "max_tokens": 6},
    },
    {"id": "m", "messages": CHAT, "sampling_params": {"temperature": 0, "max_tokens": 4}},
    {"prompt_token_ids": [11, 12, 13], "sampling_params": {"temperature": 0, "max_tokens": 3}},
    {
        "custom_id": "oc",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": CHAT, "max_tokens": 5, "temperature": 0},
    },
    {
        "custom_id": "ocmp",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": "t3 t4", "max_tokens": 5, "temperature": 0.0},
    },
]
BAD_LINES = [
    "this line is not JSON",
    json.dumps({"id": "bad-params", "prompt": "t1", "sampling_params": {"temperature": -1}}),
    json.dumps({"id": "too-long", "prompt_token_ids": [1] * 200}),
]
"""A malformed line (index 5), invalid sampling params, a prompt over max_model_len (128)."""
IDS = ["p", "m", 2, "oc", "ocmp", 5, "bad-params", "too-long"]


class BatchModel(NamedTuple):
    path: Path
    expected: dict[object, list[int]]
    """Greedy tokens of every good row by ID (from `LLM.generate` / `LLM.chat`)."""


def make_batch_model(path: Path) -> BatchModel:
    make_model(path)
    return BatchModel(path, expected_tokens(path))


def write_input(path: Path, bad: bool = True) -> Path:
    lines = [json.dumps(row) for row in GOOD_ROWS] + (BAD_LINES if bad else [])
    path.write_text("\n".join(lines) + "\n")
    return path


def make_model(path: Path) -> Path:
    """A tiny llama with the word tokenizer (chat template included) saved in `path`."""
    hf_model = save_tiny_model("llama", path)
    save_word_tokenizer(path, hf_model.config.vocab_size)
    return path


def expected_tokens(model: Path) -> dict[object, list[int]]:
    """Greedy tokens of every good row from `LLM.generate` / `LLM.chat`, by ID."""
    llm = LLM(str(model), distributed_executor_backend="uni", **ENGINE_KWARGS)
    try:
        greedy = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 4, 3, 5, 5)]
        results = llm.generate(["t5 t17 t33 t2 t9"], greedy[0])
        results += llm.chat(CHAT, greedy[1])
        results += llm.generate([[11, 12, 13]], greedy[2])
        results += llm.chat(CHAT, greedy[3])
        results += llm.generate(["t3 t4"], greedy[4])
    finally:
        llm.shutdown()
    return {row_id: r.outputs[0].token_ids for row_id, r in zip(IDS, results, strict=False)}


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def row_id(row: dict[str, Any]) -> object:
    return row["custom_id"] if "custom_id" in row else row["id"]


def check_output(rows: list[dict[str, Any]], expected: dict[object, list[int]]) -> None:
    """Every good row generated the expected tokens; every bad row is an error row."""
    by_id = {row_id(row): row for row in rows}
    assert sorted(map(str, by_id)) == sorted(map(str, IDS))
    for key, tokens in expected.items():
        row = by_id[key]
        if "response" in row:  # an OpenAI line comes back as an OpenAI batch output line
            check_openai_line(row, tokens)
            continue
        assert "error" not in row, row
        assert row["generated_tokens"] == tokens, key
        assert row["num_generated_tokens"] == len(tokens)
        # The text after the prompt's text, its separating space included (vLLM's rule).
        assert row["generated_text"] == "".join(f" t{t}" for t in tokens)
        assert row["finish_reason"] == "length"
    assert by_id["p"]["num_input_tokens"] == 5
    assert by_id["m"]["num_input_tokens"] == input_tokens(by_id["oc"]) == 5  # t1 t7 t8 t9 t2
    assert "not valid JSON" in by_id[5]["error"]
    assert "temperature must be >= 0" in by_id["bad-params"]["error"]
    assert "prompt of 200 tokens" in by_id["too-long"]["error"]


def check_openai_line(line: dict[str, Any], tokens: list[int]) -> None:
    """An OpenAI batch output line that answered with `tokens` (the word tokenizer: one word a
    token), its body as the Serve route answers it, usage included."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["error"] is None, line
    assert line["response"]["status_code"] == 200
    body = line["response"]["body"]
    (choice,) = body["choices"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert text.split() == [f"t{token}" for token in tokens]
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == len(tokens)


def input_tokens(row: dict[str, Any]) -> int:
    """The prompt's tokens of a column row or an OpenAI output line."""
    if "response" in row:
        return int(row["response"]["body"]["usage"]["prompt_tokens"])
    return int(row["num_input_tokens"])

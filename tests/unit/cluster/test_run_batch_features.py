"""`hybridserve run-batch` lines with structured outputs, tools and LoRA adapters, per line.

On the tiny byte-level model (every string reachable): a `response_format` json_schema line
answers JSON of that schema, a `tools` line with `tool_choice: required` answers tool calls whose
arguments fit their function's parameters, both parsed with the `openai` client's types. On the
word-level model: a line naming `"<model>:<adapter>"` answers transformers' greedy tokens of the
adapter merged into the model, the base line beside it the base model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.cli.main import main
from tests.helpers.byte_model import save_byte_model
from tests.helpers.serve_app import save_tiny_served_model
from tests.helpers.tiny_lora import save_random_adapter
from tests.helpers.tiny_models import hf_greedy
from tests.unit.cluster.test_openai_structured import MESSAGES, SCHEMAS, TOOLS, WEATHER

ENGINE = ["--block-size", "16", "--kv-cache-memory-bytes", str(16 << 20), "--dtype", "float32"]
PROMPT = "t5 t9 t33 t7 t100 t42"
MAX_TOKENS = 6


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _run_batch(tmp_path: Path, model: Path, name: str, lines: list[str], *flags: str) -> list[Any]:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    argv = ["run-batch", "-i", str(source), "-o", str(output), "--model", str(model)]
    assert main([*argv, "--served-model-name", name, *ENGINE, *flags]) == 0
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [line["custom_id"] for line in results] == [json.loads(x)["custom_id"] for x in lines]
    return results


def test_structured_output_and_tool_lines(tmp_path: Path) -> None:
    model = save_byte_model(tmp_path / "byte")
    schema_format = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    chat = {"model": "byte", "messages": MESSAGES, "max_tokens": 120, "temperature": 0}
    lines = [
        _line("json", "/v1/chat/completions", {**chat, "response_format": schema_format}),
        _line("tools", "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "required"}),
    ]
    answered, called = _run_batch(tmp_path, model, "byte", lines)
    reply = ChatCompletion.model_validate(answered["response"]["body"]).choices[0]
    jsonschema.validate(json.loads(reply.message.content or ""), WEATHER)
    choice = ChatCompletion.model_validate(called["response"]["body"]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        function = call.function  # type: ignore[union-attr]
        jsonschema.validate(json.loads(function.arguments), SCHEMAS[function.name])


def test_a_lora_adapter_per_line(tmp_path: Path) -> None:
    model = save_tiny_served_model(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(model)
    merged = save_random_adapter(base, tmp_path / "adapters" / "one", seed=1)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    lines = [
        _line("adapter", "/v1/completions", {**body, "model": "tiny:one"}),
        _line("base", "/v1/completions", {**body, "model": "tiny"}),
    ]
    flags = ["--dynamic-lora-loading-path", str(tmp_path / "adapters")]
    adapted, plain = _run_batch(tmp_path, model, "tiny", lines, *flags)
    prompt = AutoTokenizer.from_pretrained(model)(PROMPT)["input_ids"]
    for line, hf_model in ((adapted, merged), (plain, base)):
        text = Completion.model_validate(line["response"]["body"]).choices[0].text
        with torch.no_grad():
            tokens = hf_greedy(hf_model.float(), prompt, MAX_TOKENS)
        assert text.split() == [f"t{token}" for token in tokens], line["custom_id"]
    assert adapted["response"]["body"]["choices"] != plain["response"]["body"]["choices"]

"""Structured outputs on the embedded default model (SmolLM2-135M-Instruct, a real BPE
vocabulary of 49,152 tokens): JSON schemas, choices and a tool call's arguments all validate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from cluster.llm import LLM
from scheduler.request import SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.parity

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    },
    "required": ["name", "country", "population"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
}


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> Iterator[LLM]:
    engine = LLM(str(default_model_dir), max_model_len=512, kv_cache_memory_bytes=64 << 20)
    yield engine
    engine.shutdown()


def constrained(backend: str | None = None, **kind: object) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=48,
        structured_outputs=StructuredOutputsParams(backend=backend, **kind),  # type: ignore[arg-type]
    )


@pytest.mark.timeout(300)
def test_schemas_and_choices_on_the_default_model(llm: LLM) -> None:
    prompts = ["Describe Paris as JSON.", "Describe Tokyo as JSON.", "Is the sky blue? Answer:"]
    params = [
        constrained(json=CITY),
        constrained(json=CITY, backend="xgrammar"),
        constrained(choice=["yes", "no"]),
    ]
    outputs = [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]
    for output in outputs[:2]:
        assert output.finish_reason == "stop"
        jsonschema.validate(json.loads(output.text), CITY)
    assert outputs[2].text in ("yes", "no")


@pytest.mark.timeout(300)
def test_a_tool_call_on_the_default_model(llm: LLM) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    (out,) = llm.chat(messages, constrained(json=WEATHER), use_tqdm=False, tools=tools)
    arguments = json.loads(out.outputs[0].text)
    jsonschema.validate(arguments, WEATHER)

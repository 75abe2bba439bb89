"""Async scheduling with structured outputs: the next step is scheduled while a constrained
request's token is in flight, and its bitmask is built once that token has been accepted by the
grammar, so every text (JSON schema, regex, choice; xgrammar and llguidance) is the one of
synchronous steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from cluster.llm import LLM
from scheduler.request import SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams
from tests.helpers.byte_model import save_byte_model
from tests.helpers.engine_probe import num_scheduled_ahead

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "tag": {"enum": ["a", "bc"]}},
    "required": ["x", "tag"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{2,4}-[a-z]{2,3}"
CHOICES = ["red", "green", "blue"]
PROMPTS = ["Point:", "code", "colour?", "x"]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_byte_model(tmp_path_factory.mktemp("byte-model"))


def _params(backend: str) -> list[SamplingParams]:
    kinds: list[dict[str, object]] = [
        {"json": POINT},
        {"regex": REGEX},
        {"choice": CHOICES},
        {"regex": REGEX},
    ]
    return [
        SamplingParams(
            temperature=1.0,
            seed=seed,
            max_tokens=48,
            structured_outputs=StructuredOutputsParams(backend=backend, **kind),  # type: ignore[arg-type]
        )
        for seed, kind in enumerate(kinds)
    ]


def _run(model: Path, backend: str, async_scheduling: bool) -> tuple[list[str], int]:
    llm = LLM(
        str(model), block_size=16, kv_cache_memory_bytes=4 << 20, async_scheduling=async_scheduling
    )
    try:
        outs = llm.generate(PROMPTS, _params(backend), use_tqdm=False)
        return [out.outputs[0].text for out in outs], num_scheduled_ahead(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_structured_requests_run_ahead_with_the_texts_of_sync_steps(
    byte_model: Path, backend: str
) -> None:
    sync_texts, sync_ahead = _run(byte_model, backend, async_scheduling=False)
    texts, ahead = _run(byte_model, backend, async_scheduling=True)
    assert texts == sync_texts
    assert sync_ahead == 0
    assert ahead >= 20  # constrained requests were scheduled while their token was in flight
    jsonschema.validate(json.loads(texts[0]), POINT)
    assert re.fullmatch(REGEX, texts[1])
    assert texts[2] in CHOICES
    assert re.fullmatch(REGEX, texts[3])

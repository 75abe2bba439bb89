"""Structured outputs through `LLM.generate` on a tiny random byte-level model.

A random model follows any grammar only because the grammar forces it, so every check here fails
if the bitmask is not built, not applied, or the grammar state is not advanced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from cluster.engine.structured.backends import closed_objects
from cluster.llm import LLM
from scheduler.request import SamplingParams
from scheduler.structured_outputs import StructuredOutputsParams
from tests.helpers.byte_model import save_byte_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person:", "JSON please", "x", "Another one, with a longer prompt here"]


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_byte_model(tmp_path_factory.mktemp("byte-model"))


@pytest.fixture(scope="module")
def llm(byte_model: Path) -> Iterator[LLM]:
    engine = LLM(str(byte_model), block_size=16, kv_cache_memory_bytes=16 << 20, max_num_seqs=256)
    yield engine
    engine.shutdown()


def constrained(max_tokens: int = 96, temperature: float = 0.0, **kind: object) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        seed=7,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**kind),  # type: ignore[arg-type]
    )


def parse_json(text: str) -> object:
    """JSON as generated: xgrammar's strings admit raw control characters, which a random model
    draws and Python's strict parser refuses."""
    return json.loads(text, strict=False)


def texts(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[str]:
    return [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]


def test_json_schema_regex_choice_and_grammars_hold(llm: LLM) -> None:
    params = [
        constrained(json=PERSON),
        constrained(json=PERSON, temperature=1.0),
        constrained(json_object=True, max_tokens=200),
        constrained(regex=r"[0-9]{3}-[a-z]{2,4}"),
        constrained(choice=["yes", "no", "maybe"], temperature=1.0),
        constrained(grammar='root ::= "(" [a-c]+ ")" ";"'),
        constrained(grammar='start: "x" DIGIT DIGIT\nDIGIT: /[0-9]/'),  # Lark: llguidance
    ]
    outs = llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    got = [out.outputs[0].text for out in outs]
    for text in got[:2]:
        jsonschema.validate(parse_json(text), PERSON)
    if outs[2].outputs[0].finish_reason == "stop":  # any object: may outgrow max_tokens
        assert isinstance(parse_json(got[2]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", got[3])
    assert got[4] in ("yes", "no", "maybe")
    assert re.fullmatch(r"\([a-c]+\);", got[5])
    assert re.fullmatch(r"x[0-9]{2}", got[6])
    assert all(out.outputs[0].finish_reason == "stop" for i, out in enumerate(outs) if i != 2)


def test_a_structural_tag_wraps_its_schema(llm: LLM) -> None:
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<call>",
            "content": {"type": "regex", "pattern": "[a-z]{2,5}=[0-9]"},
            "end": "</call>",
        },
    }
    (text,) = texts(llm, PROMPTS[:1], [constrained(structural_tag=tag)])
    assert re.fullmatch(r"<call>[a-z]{2,5}=[0-9]</call>", text), text


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_each_backend_is_selectable_per_request(llm: LLM, backend: str) -> None:
    params = constrained(json=PERSON, backend=backend, temperature=1.0)
    (text,) = texts(llm, PROMPTS[:1], [params])
    jsonschema.validate(parse_json(text), PERSON)


@pytest.mark.parametrize(
    ("kind", "needle"),
    [
        ({"json": {"type": "nonsense"}}, "json"),
        ({"regex": "(ab"}, "regex"),
        ({"grammar": "root ::= "}, "grammar"),
        ({"json": PERSON, "backend": "outlines"}, "outlines"),
    ],
)
def test_an_invalid_constraint_is_refused_naming_it(llm: LLM, kind: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**kind)))
    assert texts(llm, ["x"], [SamplingParams(max_tokens=2)])  # the engine goes on


def test_a_constraint_needs_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_an_unfinishable_constraint_ends_with_length(llm: LLM) -> None:
    (out,) = llm.generate(["x"], constrained(regex="a{50}", max_tokens=5), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == "a" * 5


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    plain = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(seed=3, max_tokens=24)]
    alone = texts(llm, PROMPTS[:2], plain)
    mixed_params = [constrained(json=PERSON), plain[0], constrained(regex="[a-z]+;"), plain[1]]
    mixed = texts(llm, [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]], mixed_params)
    assert [mixed[1], mixed[3]] == alone
    jsonschema.validate(parse_json(mixed[0]), PERSON)


def test_a_preempted_constrained_request_resumes_its_grammar(byte_model: Path) -> None:
    """A KV cache of 24 blocks of 16 tokens cannot hold 6 requests of ~140 tokens: requests are
    preempted mid-output and resumed; their outputs still follow the grammar and equal an
    unpreempted run's (greedy)."""
    params = [constrained(json=PERSON, max_tokens=120)] * 3 + [
        constrained(regex=r"([a-z]{3},){30}", max_tokens=120)
    ] * 3
    prompts = [p + " " + "pad " * 4 for p in PROMPTS[:3]] * 2
    roomy = LLM(str(byte_model), block_size=16, kv_cache_memory_bytes=16 << 20)
    try:
        expected = texts(roomy, prompts, params)
    finally:
        roomy.shutdown()
    block_bytes = 16 * 4 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x kv heads x head dim x fp32
    tight = LLM(
        str(byte_model), block_size=16, kv_cache_memory_bytes=24 * block_bytes, max_model_len=192
    )
    try:
        got = texts(tight, prompts, params)
        preemptions = tight.client.core.get_stats().num_preemptions  # type: ignore[attr-defined]
    finally:
        tight.shutdown()
    assert preemptions > 0
    assert got == expected
    for text in got[:3]:
        jsonschema.validate(parse_json(text), PERSON)
    for text in got[3:]:
        assert re.fullmatch(r"([a-z]{3},){30}", text)


def test_llm_chat_passes_tools_to_the_template(llm: LLM) -> None:
    tools = [{"type": "function", "function": {"name": "get_age", "parameters": PERSON}}]
    messages = [{"role": "user", "content": "Who?"}]
    (out,) = llm.chat(messages, constrained(json=PERSON), use_tqdm=False, tools=tools)
    assert out.prompt is not None
    assert '"name": "get_age"' in out.prompt
    jsonschema.validate(parse_json(out.outputs[0].text), PERSON)


def test_objects_admit_only_the_listed_properties_unless_the_schema_says() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"properties": {"b": {}}}}},
        "$defs": {"d": {"properties": {"c": {}}, "additionalProperties": True}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the caller's schema is left alone
